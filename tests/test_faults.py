"""Kill one process of a real `sao train` with SIGKILL, then check what the run did (tests/faults.py):
a rollout worker (local, Ray) is restarted and its episodes run again; a trainer rank (local, Ray) or
a critic process stops the run in one line with nothing left behind; the trainer itself (local, thread
backend) leaves nothing behind. Every run is finished by --resume where it stopped, and its audit shows
no episode lost or trained twice."""

import pytest
from faults import FAULTS, kill_and_check


@pytest.mark.slow
@pytest.mark.parametrize("fault", [f for f in FAULTS if not f.ray], ids=lambda f: f.name)
def test_a_killed_process(fault, tmp_path):
    kill_and_check(fault, tmp_path)


@pytest.mark.ray
@pytest.mark.parametrize("fault", [f for f in FAULTS if f.ray], ids=lambda f: f.name)
def test_a_killed_ray_actor(fault, tmp_path, ray_address):
    kill_and_check(fault, tmp_path, ray_address)
