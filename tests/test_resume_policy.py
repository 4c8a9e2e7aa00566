"""The resume policy, complete (issue 45 item 8): every setting is classified, a change of
anything that shaped the run is refused naming the flag itself, and the docs' sentence
is made from the same table."""
import dataclasses

import pytest

from gluon_unet.config import _CHOICES, ModelConfig, TrainConfig, flag_name
from gluon_unet.data import synthetic_dataset
from gluon_unet.training.loop import fit
from gluon_unet.errors import UserError
from gluon_unet.training.resume import RESUME_POLICY, check_resumable, resume_conflicts, resume_policy_text

SETTINGS = [f.name for f in dataclasses.fields(TrainConfig) if f.name != 'model'] + \
    [f.name for f in dataclasses.fields(ModelConfig)]


def test_every_setting_is_classified_once():
    assert sorted(RESUME_POLICY) == sorted(SETTINGS)
    assert {r.kind for r in RESUME_POLICY.values()} == {'refuse', 'data', 'allow'}
    assert all(r.shapes for r in RESUME_POLICY.values())
    assert all(bool(r.when) == (r.key is not None) for r in RESUME_POLICY.values())


def _where_it_counts(name):
    """A config in which ``name`` counts (its rule's condition holds)."""
    cfg = TrainConfig(optimizer='sgd', lr_schedule='step', loss='bce_dice', amp=True, normalize='percentile',
                      monitor='val_dsb')
    if name == 'weight_on':
        cfg.loss = 'wbce_dice'
    return cfg


def _other_value(cfg, name):
    """Another valid value of the setting ``name``."""
    obj = cfg.model if hasattr(cfg.model, name) else cfg
    value = getattr(obj, name)
    choices = _CHOICES.get(name)
    special = {'kvstore': 'dist_async', 'lr_steps': '0.5', 'in_channels': 3, 'gpus': '0', 'val_data': 'v/',
               'data': 'elsewhere/', 'masks': 'm/', 'cache_dir': 'c/', 'output': 'o/', 'resume': 'auto',
               'workers': 4, 'update_on_kvstore': True, 'mask_suffix': '_m', 'scale_aug': '0.5,2.0',
               'predict_diameter': 'range', 'init': 'nuclei@sha256:00', 'plane': 1}
    if name in special:
        return special[name]
    if choices:
        return [c for c in choices if c != value][0]
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 16
    if isinstance(value, float):
        return value + 0.25 if value < 0.5 else value / 2
    raise AssertionError('no other value for %s' % name)


def _changed(cfg, name):
    other = TrainConfig.from_dict(cfg.to_dict())
    setattr(other.model if hasattr(other.model, name) else other, name, _other_value(cfg, name))
    return other


@pytest.mark.parametrize('name', SETTINGS)
def test_a_change_is_refused_naming_the_flag_exactly_when_the_table_says_so(name):
    saved = _where_it_counts(name)
    rule = RESUME_POLICY[name]
    conflicts = resume_conflicts(saved, _changed(saved, name))
    if rule.kind == 'refuse':
        assert len(conflicts) == 1 and conflicts[0].startswith(flag_name(name) + ' '), conflicts
    else:
        assert conflicts == []
    data = resume_conflicts(saved, _changed(saved, name), kind='data')
    assert (len(data) == 1) == (rule.kind == 'data'), data


@pytest.mark.parametrize('name, condition', [
    ('momentum', {'optimizer': 'adam'}), ('nesterov', {'optimizer': 'adam'}),
    ('lr_steps', {'lr_schedule': 'cosine'}), ('epochs', {'lr_schedule': 'constant'}),
    ('dice_weight', {'loss': 'bce'}), ('weight_on', {'loss': 'bce'}), ('amp_dtype', {'amp': False}),
    ('denoise', {'normalize': 'none'}), ('threshold', {'monitor': 'val_iou'}),
    ('monitor', {'val_split': 0.0}), ('scale_aug', {'augment': False}),
])
def test_a_setting_that_does_not_count_in_the_run_may_change(name, condition):
    saved = _where_it_counts(name)
    for key, value in condition.items():
        setattr(saved, key, value)
    assert resume_conflicts(saved, _changed(saved, name)) == []


def test_only_a_switch_to_or_from_dist_async_is_another_update():
    assert resume_conflicts(TrainConfig(kvstore='device'), TrainConfig(kvstore='local')) == []
    assert resume_conflicts(TrainConfig(kvstore='dist_sync'), TrainConfig(kvstore='dist_async')) == \
        ['--kvstore dist_sync (now dist_async)']


def test_the_docs_sentence_names_every_flag_the_table_classifies():
    text = resume_policy_text()
    for name, rule in RESUME_POLICY.items():
        if name not in ('resume', 'overwrite', 'benchmark'):
            assert text.count('`%s`' % flag_name(name)) == 1, name
        if rule.when:
            assert '`%s` %s' % (flag_name(name), rule.when) in text
    assert '\n' not in text


def test_a_changed_normalize_is_named_as_itself_not_as_changed_data(tiny):
    saved = tiny(normalize='none')
    meta = {'config': saved.to_dict(), 'data': {'train': 10, 'val': 2, 'names_sha1': 'a', 'content_sha1': 'b'}}
    other_pixels = {'train': 10, 'val': 2, 'names_sha1': 'a', 'content_sha1': 'c', 'workers': 1}
    with pytest.raises(UserError, match=r'--normalize none \(now percentile\)') as err:
        check_resumable('run', meta, tiny(normalize='percentile'), other_pixels)
    assert 'data changed' not in str(err.value)
    # Data read from another place with another suffix, and other pixels: the data
    # changed, and the message says how it was read.
    with pytest.raises(UserError, match=r'the data changed .* read with --mask-suffix _mask \(now _m\)'):
        check_resumable('run', meta, tiny(mask_suffix='_m'), other_pixels)


def test_resume_refuses_what_it_used_to_take_silently(tiny):
    # The observations: a changed --monitor was compared with the old metric's best
    # value (the export kept the wrong epoch); --loss, --no-augment and --clip-grad were
    # taken although they change the update or the batches.
    ds = synthetic_dataset(12, size=32, seed=0)
    common = dict(epochs=2, lr_schedule='constant', val_split=0.25)
    fit(tiny(**common), train_ds=ds, verbose=False, callbacks=[lambda r: r['epoch'] == 1])
    for change, named in [({'monitor': 'val_loss'}, '--monitor val_iou (now val_loss)'),
                          ({'loss': 'bce_dice'}, '--loss bce (now bce_dice)'),
                          ({'augment': True}, '--augment False (now True)'),
                          ({'clip_grad': 1.0}, '--clip-grad 0.0 (now 1.0)')]:
        with pytest.raises(UserError) as err:
            fit(tiny(resume='auto', **dict(common, **change)), train_ds=ds, verbose=False)
        assert '--resume' in str(err.value) and named in str(err.value), str(err.value)
