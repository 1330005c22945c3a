"""The scenario harness itself: a case failing on some ranks only ends the
run with an error naming the case and the failing rank's traceback.

Without the harness's check, the failed rank runs on into later cases while
the others still wait in the failed case's collective: their collectives pair
with unrelated ones (here the last rank's closing barrier, so the run ends on
a closed connection that names no case) or, when nothing pairs, everyone waits
until the process group's timeout (30 minutes).
"""

from __future__ import annotations

import pytest

from conftest import launch


def test_case_failing_on_one_rank_ends_the_run(tmp_path) -> None:
    with pytest.raises(AssertionError) as raised:
        launch("harness", tmp_path, world=2, env={"SCENARIO_PEER_WAIT": "2"})
    message = str(raised.value)
    assert "scenario 'one_rank_fails': rank 1 finished it (failed)" in message
    assert "this rank fails alone" in message
