"""bin/train --benchmark: a table for people, then one JSON line for scripts."""
import json

from gluon_unet.training import benchmark
from gluon_unet.cli import train_main


def _last_json(capsys):
    out = capsys.readouterr().out.strip().splitlines()
    return out, json.loads(out[-1])


def test_benchmark_cli_last_line_is_json(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(benchmark, 'REPEATS', 2)
    monkeypatch.setattr(benchmark, 'MIN_REPEAT_SECONDS', 0.0)
    code = train_main(['--benchmark', '--width', '4', '--depth', '2', '--size', '32',
                       '--batch-size', '4', '--cpus', '2', '--output', str(tmp_path / 'run'),
                       '--no-progress'])
    assert code == 0
    lines, record = _last_json(capsys)
    assert set(record) == {'images_per_s', 'per_device', 'devices', 'scaling_efficiency', 'gflops', 'cpu'}
    from gluon_unet.machine.cpu import cpu_description
    assert record['cpu'] == cpu_description() and 'AVX' in record['cpu']  # which machine the figure is from
    assert record['devices'] == 2
    assert isinstance(record['per_device'], list) and len(record['per_device']) == 2
    assert record['images_per_s'] > 0 and record['gflops'] > 0 and record['scaling_efficiency'] > 0
    # An even split: each device does half of the images of every step.
    assert abs(sum(record['per_device']) - record['images_per_s']) < 1e-6 * record['images_per_s']
    assert record['per_device'][0] == record['per_device'][1]
    assert any('scaling efficiency' in line for line in lines[:-1])
    assert not (tmp_path / 'run').exists()  # a benchmark writes no run folder


def test_run_benchmark_single_device_and_gflops(tiny):
    cfg = tiny(batch_size=3, size=32)
    rec = benchmark.run_benchmark(cfg, warmup=1, repeats=1)
    assert rec['devices'] == 1 and rec['scaling_efficiency'] == 1.0
    # 3 * (rate / 3) may differ from rate in the last bit: compare relatively.
    assert len(rec['per_device']) == 1
    assert abs(rec['per_device'][0] - rec['images_per_s']) < 1e-9 * rec['images_per_s']
    expected = rec['images_per_s'] * 3 * benchmark.flops_per_image(cfg.model, 32) / 1e9
    assert abs(rec['gflops'] - expected) < 1e-9


def test_uneven_batch_uses_the_trainer_split(tiny):
    cfg = tiny(batch_size=5, size=32, cpus=2)
    rec = benchmark.run_benchmark(cfg, warmup=1, repeats=1)
    # 5 over 2 devices -> 3 + 2, as DataParallelStep splits it.
    assert rec['per_device_batch'] == 3
    assert abs(rec['per_device'][0] / rec['per_device'][1] - 1.5) < 1e-9




def test_benchmark_runs_every_kind_of_target_and_loss(tiny):
    """The synthetic batch is shaped like the loader's for each target (a border model's
    target has two maps) and the weighted loss."""
    for kw in ({'target': 'mask+border', 'loss': 'bce_dice'}, {'loss': 'wbce'},
               {'target': 'mask+border', 'loss': 'wbce'}):
        rec = benchmark.run_benchmark(tiny(batch_size=2, size=32, **kw), warmup=1, repeats=1)
        assert rec['images_per_s'] > 0, kw
