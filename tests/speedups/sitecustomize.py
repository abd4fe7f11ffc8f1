"""Python runs this at the start of every process whose ``PYTHONPATH`` holds this folder (``tests/conftest.py``
puts it there for the suite's processes): the suite's start-up speed-ups (``sonar_test_speedups``). A
failure here must never stop a process: it only costs the time they save."""
try:
    import sonar_test_speedups

    sonar_test_speedups.install()
except Exception:  # noqa: BLE001 - a speed-up, never a reason for a process to fail
    pass
