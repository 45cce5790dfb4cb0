"""Fast tests of each module: seconds, nothing beyond the test extras (`pytest -m unit`)."""
