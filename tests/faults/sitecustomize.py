"""Imported by every Python started with this directory on PYTHONPATH: installs the test faults.

The supervision tests put this directory on a job's PYTHONPATH (`launch --env PYTHONPATH=...`) together
with FLASHDRAFT_TEST_FAULT; see flashdraft_test_faults.py for the spelling."""

import flashdraft_test_faults

flashdraft_test_faults.install()
