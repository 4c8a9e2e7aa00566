"""SIGTERM and Ctrl-C at every stage of a run - during an epoch, as the last epoch's
checkpoint is written, during the post-processing search after the last epoch, during
the export - and during bin/export: the exit code says which signal, one
line says what was saved and how to continue, nothing is half-written, and the advice
works. Signals are sent to this process at the chosen moment (in-process runs)."""
import json
import os
import signal

import mxnet as mx
import pytest

from gluon_unet.training import loop as engine, recorder
from gluon_unet.inference import postprocess_search as search
from gluon_unet.checkpoint import list_checkpoints, load_checkpoint
from gluon_unet.cli import export_main, train_main
from gluon_unet.inference.batched import load_exported

from conftest import run_cli

SIGNALS = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]  # SIGHUP: a closed terminal, a stop like SIGTERM
TRAIN = ['--width', '4', '--depth', '2', '--size', '32', '--batch-size', '8', '--synthetic-count', '24',
         '--workers', '0', '--no-progress', '--patience', '0', '--epochs', '2', '--lr-schedule', 'constant',
         '--no-hybridize']


pytestmark = pytest.mark.usefixtures('guarded_signals')  # conftest: an unhandled stop fails the test


def _send(signum, times=1):
    for _ in range(times):
        os.kill(os.getpid(), signum)


def _one_line(capsys, out=None):
    """The one line on stderr; with a run folder ``out``, also the last line of its train.log."""
    err = capsys.readouterr().err.strip()
    assert err and err.splitlines() == [err] and 'Traceback' not in err, err
    if out is not None:
        with open(os.path.join(out, 'train.log')) as f:
            assert f.read().splitlines()[-1].endswith(' ' + err), 'the stop line is not the end of train.log'
    return err


def _temporary_files(root):
    return [os.path.join(d, n) for d, dirs, files in os.walk(root) for n in dirs + files if n.startswith('.tmp')]


def _checkpoints_load(out):
    folder = os.path.join(out, 'checkpoints')
    for path in list_checkpoints(folder) + [os.path.join(folder, 'best.ckpt')]:
        load_checkpoint(path)


@pytest.mark.parametrize('signum', SIGNALS, ids=lambda s: s.name)
def test_a_signal_during_an_epoch_saves_a_checkpoint_and_says_how_to_continue(tmp_path, monkeypatch, capsys,
                                                                              signum):
    out = str(tmp_path / 'run')
    real = engine.validate
    calls = []

    def validate_then_signal(*args, **kwargs):  # during epoch 1's validation
        calls.append(1)
        if len(calls) == 1:
            _send(signum)
        return real(*args, **kwargs)
    monkeypatch.setattr(engine, 'validate', validate_then_signal)
    capsys.readouterr()
    assert run_cli(train_main, TRAIN + ['--output', out]) == 128 + signum
    err = _one_line(capsys, out)
    saved = list_checkpoints(os.path.join(out, 'checkpoints'))[-1]
    assert err.startswith(signum.name) and 'saved %s' % saved in err and '--resume auto' in err, err
    assert load_checkpoint(saved)['epoch'] == 1 and not _temporary_files(out)
    _checkpoints_load(out)
    assert not os.path.exists(os.path.join(out, 'export'))
    if signum == signal.SIGTERM:  # the advice works
        monkeypatch.setattr(engine, 'validate', real)
        assert run_cli(train_main, TRAIN + ['--output', out, '--resume', 'auto']) == 0
        load_exported(out)


@pytest.mark.parametrize('signum', SIGNALS, ids=lambda s: s.name)
def test_a_signal_as_the_last_epochs_checkpoint_is_written_is_honoured(tmp_path, monkeypatch, capsys, signum):
    # Between two phases: the epoch loop is over, the search has not begun. A stop asked
    # for then is carried into the next phase, which does not run: never search, export
    # and exit 0 as though no one had asked.
    out = str(tmp_path / 'run')
    real = recorder.RunRecorder.end_epoch

    def end_epoch_then_signal(self, net, trainer, state, *args, **kwargs):
        result = real(self, net, trainer, state, *args, **kwargs)
        if state.epoch == 2:  # the last one: its checkpoint and curves are written
            _send(signum)
        return result
    monkeypatch.setattr(recorder.RunRecorder, 'end_epoch', end_epoch_then_signal)
    capsys.readouterr()
    assert run_cli(train_main, TRAIN + ['--output', out]) == 128 + signum
    err = _one_line(capsys, out)
    assert err.startswith('%s as the last epoch (2) ended: training is complete' % signum.name), err
    assert 'the export was not written' in err and '--resume auto' in err, err
    assert not os.path.exists(os.path.join(out, 'export')) and not _temporary_files(out)
    _checkpoints_load(out)
    monkeypatch.setattr(recorder.RunRecorder, 'end_epoch', real)
    assert run_cli(train_main, TRAIN + ['--output', out, '--resume', 'auto']) == 0  # the advice finishes it
    load_exported(out)


@pytest.mark.parametrize('signum', SIGNALS, ids=lambda s: s.name)
def test_a_signal_during_the_search_says_training_is_complete_and_how_to_finish(tmp_path, monkeypatch, capsys,
                                                                                signum):
    out = str(tmp_path / 'run')
    real = search.tune_on_maps

    def search_then_signal(*args, **kwargs):  # the maps are predicted; the settings are being scored
        _send(signum)
        return real(*args, **kwargs)
    monkeypatch.setattr(search, 'tune_on_maps', search_then_signal)
    capsys.readouterr()
    assert run_cli(train_main, TRAIN + ['--output', out]) == 128 + signum
    err = _one_line(capsys, out)
    assert err.startswith('%s during the post-processing search after the last epoch (2)' % signum.name), err
    assert 'training is complete' in err and 'the export was not written' in err, err
    assert 'bin/export %s --tune-postprocess' % out in err and '--resume auto' in err, err
    assert not os.path.exists(os.path.join(out, 'export')) and not _temporary_files(out)
    _checkpoints_load(out)
    monkeypatch.setattr(search, 'tune_on_maps', real)
    # Either piece of advice finishes the job: the export, with the searched settings.
    if signum == signal.SIGINT:
        assert run_cli(export_main, [out, '--tune-postprocess']) == 0
    else:
        assert run_cli(train_main, TRAIN + ['--output', out, '--resume', 'auto']) == 0
    _, meta = load_exported(out)
    assert 'postprocess' in meta


@pytest.mark.parametrize('signum', SIGNALS, ids=lambda s: s.name)
def test_a_signal_during_the_export_lets_it_finish(tmp_path, monkeypatch, capsys, signum):
    out = str(tmp_path / 'run')
    real = recorder.export_checkpoint

    def export_after_a_signal(*args, **kwargs):
        _send(signum)
        return real(*args, **kwargs)
    monkeypatch.setattr(recorder, 'export_checkpoint', export_after_a_signal)
    capsys.readouterr()
    assert run_cli(train_main, TRAIN + ['--output', out]) == 128 + signum
    err = _one_line(capsys, out)
    assert err.startswith('%s during the export' % signum.name) and 'the export was finished first' in err, err
    _, meta = load_exported(out)
    assert 'postprocess' in meta and not _temporary_files(out)  # the whole export, the search's settings too


def test_a_second_signal_during_the_export_stops_it_and_leaves_no_half_export(tmp_path, monkeypatch, capsys):
    out = str(tmp_path / 'run')
    real = mx.gluon.HybridBlock.export

    def written_then_two_signals(self, *args, **kwargs):  # the files are in the temporary folder
        result = real(self, *args, **kwargs)
        _send(signal.SIGTERM, times=2)
        return result
    monkeypatch.setattr(mx.gluon.HybridBlock, 'export', written_then_two_signals)
    capsys.readouterr()
    assert run_cli(train_main, TRAIN + ['--output', out]) == 143
    err = _one_line(capsys, out)
    assert err.startswith('SIGTERM during the export') and 'the export was not written' in err, err
    assert 'bin/export %s --tune-postprocess' % out in err, err
    assert not os.path.exists(os.path.join(out, 'export')) and not _temporary_files(out)
    _checkpoints_load(out)


def test_sigterm_during_bin_export_keeps_the_previous_export_and_leaves_no_temporary_folder(tmp_path, monkeypatch,
                                                                                          capsys):
    out = str(tmp_path / 'run')
    assert run_cli(train_main, TRAIN + ['--output', out]) == 0
    before = {n: open(os.path.join(out, 'export', n), 'rb').read() for n in os.listdir(os.path.join(out, 'export'))}
    real = mx.gluon.HybridBlock.export

    def written_then_sigterm(self, *args, **kwargs):
        result = real(self, *args, **kwargs)
        _send(signal.SIGTERM)
        return result
    monkeypatch.setattr(mx.gluon.HybridBlock, 'export', written_then_sigterm)
    capsys.readouterr()
    assert run_cli(export_main, [out]) == 143
    line = _one_line(capsys)
    assert 'stopped by SIGTERM' in line and line.endswith('keeps the export it had'), line
    assert not _temporary_files(out)
    after = {n: open(os.path.join(out, 'export', n), 'rb').read() for n in os.listdir(os.path.join(out, 'export'))}
    assert after == before
    assert 'postprocess' in json.loads(after['model.json'])
