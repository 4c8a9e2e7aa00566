"""The GPU lane: the multi-device guarantees on ``mx.gpu(i)`` contexts.

Every test here is marked ``gpu`` and runs where MXNet sees GPUs (``min_gpus`` of them);
elsewhere it is collected and skipped with the reason (``python -m pytest -m gpu -rs``:
"SKIPPED ... no GPU: <why>", from :func:`gluon_unet.machine.gpus.gpu_status`). The assertions
are the functions in ``device_checks.py`` that the CPU-context tests run on this machine
(test_parallel, test_syncbn_amp, test_device_checks); only the devices and the
tolerances differ (cuDNN chooses algorithms per shape; TF32 is off:
``NVIDIA_TF32_OVERRIDE=0`` in conftest).

Written against MXNet 1.9.1's documented GPU behaviour; no machine of the project has a
GPU, so the first run on one is their first run.
"""
import os
import subprocess
import sys

import mxnet as mx
import pytest

from device_checks import (GPU_TOL, check_amp_trains_and_exports_float32, check_benchmark_json,
                           check_clipping_device_invariant, check_devices_equivalent,
                           check_ema_checkpoint_holds_only_cpu_arrays, check_export_predicts_like_cpu,
                           check_loader_pins_memory, check_resume_across_device_counts,
                           check_running_stats_match_imperative, check_sync_bn_matches_whole_batch,
                           check_sync_bn_uneven_batch_matches_one_device, child_env, engine_step_trainer,
                           gpu_contexts)
from gluon_unet.machine import devices, gpus as hardware
from hang import HANG_SECONDS


def _gpus():
    return hardware.num_gpus()


@pytest.mark.gpu
def test_device_probe_passes_on_every_gpu():
    for i in range(_gpus()):
        assert hardware.probe_gpu(i) is None, hardware.probe_gpu(i)
        name, cc = hardware.gpu_properties(i)
        print('gpu(%d): %s, compute %s' % (i, name, cc))
        assert name and cc and hardware.build_supports(cc) is not False
    assert devices.make_contexts('all') == gpu_contexts(_gpus())


@pytest.mark.gpu(min_gpus=2)
@pytest.mark.parametrize('kvstore', ['device', 'nccl'])
def test_same_parameters_on_1_and_n_gpus_with_uneven_batches(tiny, kvstore):
    check_devices_equivalent(gpu_contexts, range(2, min(4, _gpus()) + 1), kvstore, tiny(), tol=GPU_TOL)


@pytest.mark.gpu(min_gpus=2)
def test_gradient_clipping_is_gpu_count_invariant(tiny):
    check_clipping_device_invariant(gpu_contexts, 2, tiny(), tol=GPU_TOL)


@pytest.mark.gpu(min_gpus=2)
def test_batchnorm_running_statistics_on_two_gpus_match_the_imperative_step(tiny):
    check_running_stats_match_imperative(gpu_contexts, 2, tiny, tol=GPU_TOL)


@pytest.mark.gpu(min_gpus=2)
def test_sync_bn_on_two_gpus_equals_batchnorm_over_the_whole_batch(tiny):
    check_sync_bn_matches_whole_batch(gpu_contexts, tiny, tol=1e-3)


@pytest.mark.gpu(min_gpus=2)
def test_float16_amp_trains_on_gpus_and_exports_float32(tmp_path):
    check_amp_trains_and_exports_float32(tmp_path, {'gpus': '0,1'})


@pytest.mark.gpu(min_gpus=2)
def test_export_of_multi_gpu_training_predicts_like_cpu(tiny):
    cfg = tiny(epochs=1, gpus='0,1', batch_norm=True, sync_bn=True)
    check_export_predicts_like_cpu(cfg, gpu_contexts(2), tol=GPU_TOL)


@pytest.mark.gpu(min_gpus=2)
def test_benchmark_json_line_on_gpus(capsys, monkeypatch, tmp_path):
    check_benchmark_json(capsys, monkeypatch, tmp_path, ['--gpus', '0,1'], 2)


@pytest.mark.gpu(min_gpus=2)
def test_nccl_updates_on_each_gpu_not_on_the_kvstore(tiny):
    # KVStoreNCCL keeps every merge buffer on devs[0] ("always use devs[0] as root",
    # kvstore_nccl.h): with the update there, GPU 0 would hold all optimizer state.
    trainer = engine_step_trainer(tiny(gpus='0,1', kvstore='nccl'), gpu_contexts(2))
    assert trainer._kvstore is not None and trainer._kvstore.type == 'nccl'
    assert trainer._update_on_kvstore is False


@pytest.mark.gpu
def test_loader_pins_memory_when_feeding_gpus():
    check_loader_pins_memory(0)


@pytest.mark.gpu(min_gpus=2)
def test_gpus_4_7_style_renumbering_shows_mxnet_only_the_requested_gpus():
    # bin/train --gpus 1: CUDA_VISIBLE_DEVICES=1 before mxnet loads, so MXNet's gpu(0) is
    # GPU 1 (the same card: CUDA keeps its order) and GPU 0 gets no CUDA context.
    expected_name = hardware.gpu_properties(1)[0]
    code = ('import os, sys\n'
            'from gluon_unet.machine import runtime\n'
            'print(runtime.prepare_training_process("1", 1))\n'
            'import mxnet as mx\n'
            'from gluon_unet.machine import devices, gpus as hardware\n'
            'ctxs = devices.make_contexts("1")\n'
            'print(ctxs, devices.context_names(ctxs), mx.context.num_gpus(), os.environ["CUDA_VISIBLE_DEVICES"],\n'
            '      "OMP_NUM_THREADS" in os.environ)\n'
            'print(hardware.gpu_properties(0)[0])\n')
    env = child_env()
    env.pop('CUDA_VISIBLE_DEVICES', None)
    env.pop('OMP_NUM_THREADS', None)
    done = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=HANG_SECONDS, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert lines[-3] == '{0: 1}'
    assert lines[-2] == '[gpu(0)] gpu(0)=GPU 1 1 1 False'
    assert lines[-1] == expected_name


@pytest.mark.gpu
def test_float16_amp_trains_on_one_gpu(tmp_path):
    # One GPU is enough for the AMP path itself (the 2-GPU test above adds the kvstore).
    check_amp_trains_and_exports_float32(tmp_path, {'gpus': '0'})


@pytest.mark.gpu
def test_gpu_context_reads_back_what_it_computed():
    x = mx.nd.arange(6, ctx=mx.gpu(0)).reshape((2, 3))
    assert (x * 2).asnumpy().tolist() == [[0, 2, 4], [6, 8, 10]]
    assert os.environ.get('NVIDIA_TF32_OVERRIDE') == '0'


@pytest.mark.gpu(min_gpus=2)
@pytest.mark.parametrize('before, after', [(1, 2), (2, 1)])
@pytest.mark.parametrize('mode', ['kvstore', 'local'])
def test_adam_resumed_on_another_gpu_count_matches_an_unbroken_run(tmp_path, before, after, mode):
    # With update_on_kvstore the device kvstore updates each key on its merge buffer's GPU
    # (CommDevice::InitMergeBuffer) and counts Adam's steps under that GPU's id; another
    # GPU count moves keys between GPUs. tests/test_resume_devices.py runs the CPU matrix.
    check_resume_across_device_counts(gpu_contexts, before, after, 'adam', mode, tmp_path, tol=GPU_TOL)


@pytest.mark.gpu(min_gpus=3)
def test_sync_bn_on_3_gpus_with_a_batch_of_8_equals_one_gpu_on_the_samples_it_trains(tiny):
    check_sync_bn_uneven_batch_matches_one_device(gpu_contexts, tiny, ndev=3, n=8, tol=1e-3)


@pytest.mark.gpu
def test_an_ema_checkpoint_of_a_gpu_run_holds_only_cpu_arrays(tmp_path):
    # mx.nd.load would put an array saved from gpu(k) back on gpu(k) wherever one is visible.
    check_ema_checkpoint_holds_only_cpu_arrays(gpu_contexts(min(2, _gpus())), tmp_path)


@pytest.mark.gpu
def test_the_pinned_memory_benchmark_prints_the_three_ways():
    done = subprocess.run([sys.executable, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                        'benchmarks', 'bench_pinned.py'),
                           '--batch', '4', '--side', '64', '--batches', '3', '--rounds', '1'],
                          capture_output=True, text=True, timeout=HANG_SECONDS, env=child_env())
    assert done.returncode == 0, done.stderr[-2000:]
    import json
    record = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(record) == {'batch_mb', 'pageable_ms', 'per-batch_ms', 'ring_ms'}
    assert all(v > 0 for v in record.values())


@pytest.mark.gpu
def test_probing_a_gpu_leaves_nothing_for_exit():
    # probe_gpu waits for the engine after its kernels: nothing is rethrown at exit.
    code = ('from gluon_unet.machine import gpus as hardware\n'
            'print(hardware.probe_gpu(0))\n')
    done = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=HANG_SECONDS,
                          env=child_env())
    assert done.returncode == 0 and done.stdout.strip() == 'None' and not done.stderr.strip(), done.stderr
