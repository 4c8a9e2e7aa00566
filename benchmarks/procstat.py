"""What /proc says about this process and the machine: CPU-seconds machine-wide, per-thread CPU
ticks, resident memory. Shared by the benchmarks that must tell their own load from other
processes' (``bench_train.py``'s workers, ``bench_step_stalls.py``)."""
import os


def busy_seconds():
    """CPU-seconds all processes (and the hypervisor: steal) used so far, machine-wide."""
    with open('/proc/stat') as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    # user nice system idle iowait irq softirq steal; guest time is inside user
    return (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / os.sysconf('SC_CLK_TCK')


def thread_ticks():
    """{thread id: (name, CPU ticks so far)} of this process's threads (``/proc/self/task``).
    A thread that ends between the listing and the read is skipped."""
    out = {}
    for tid in os.listdir('/proc/self/task'):
        try:
            with open('/proc/self/task/%s/stat' % tid) as f:
                stat = f.read()
        except OSError:
            continue
        # The name is in parentheses and may hold spaces; utime, stime are fields 14, 15.
        name = stat[stat.index('(') + 1:stat.rindex(')')]
        fields = stat[stat.rindex(')') + 2:].split()
        out[tid] = (name, int(fields[11]) + int(fields[12]))
    return out


def thread_busy(before, after, wall):
    """Each thread's CPU time between two :func:`thread_ticks` snapshots as a share of
    ``wall`` seconds, busiest first: [(share, name), ...] (threads below 1 % left out)."""
    tck = os.sysconf('SC_CLK_TCK')
    busy = [((ticks - before.get(tid, (name, 0))[1]) / tck / wall, name) for tid, (name, ticks) in after.items()]
    return sorted((b for b in busy if b[0] >= 0.01), reverse=True)


def rss_kib(field):
    """This process's ``field`` of ``/proc/self/status`` in KiB (``VmRSS``: resident now,
    ``VmHWM``: the peak so far); 0 where the kernel does not report it."""
    with open('/proc/self/status') as f:
        for line in f:
            if line.startswith(field + ':'):
                return int(line.split()[1])
    return 0
