"""The GPU lane's remaining checks, run here on CPU contexts (device_checks.py): the same
functions tests/test_gpu.py calls with mx.gpu(i), so their logic is exercised on every
run. (1 vs N devices, clipping, SyncBN and AMP run from test_parallel and
test_syncbn_amp.)"""
import mxnet as mx

from device_checks import (CPU_TOL, check_benchmark_json, check_export_predicts_like_cpu, check_loader_pins_memory,
                           cpu_contexts, engine_step_trainer)


def test_export_of_two_device_training_predicts_on_several_devices_like_on_one_cpu(tiny):
    cfg = tiny(epochs=1, cpus=2, batch_norm=True, sync_bn=True)
    check_export_predicts_like_cpu(cfg, cpu_contexts(2), tol=CPU_TOL)


def test_benchmark_json_line_on_two_cpu_contexts(capsys, monkeypatch, tmp_path):
    check_benchmark_json(capsys, monkeypatch, tmp_path, ['--cpus', '2'], 2)


def test_the_engine_step_updates_where_it_was_told(tiny):
    # On GPUs: nccl must update on the devices (test_gpu); the same path on CPU contexts.
    trainer = engine_step_trainer(tiny(cpus=2, kvstore='device', update_on_kvstore=False), cpu_contexts(2))
    assert trainer._kvstore is not None and trainer._kvstore.type == 'device'
    assert trainer._update_on_kvstore is False


def test_the_loader_pins_batches_for_the_gpu_it_feeds():
    # A CPU build allocates cpu_pinned as ordinary memory, but the context is the same.
    batch = check_loader_pins_memory(0)
    assert batch[0].context == mx.Context('cpu_pinned', 0)
