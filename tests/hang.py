"""How long a test waits on a subprocess before it calls it hung."""
# A guard against hangs only: no test measures speed (benchmarks/ does). It is set for a
# busy 2-core CI machine, where a CLI run that takes 20 s alone has taken over two minutes;
# a test whose subject is how fast something stops (a signal, a watchdog) says so with its
# own bound instead. tests/test_hang_rule.py holds every subprocess wait in tests/ to it.
HANG_SECONDS = 900
