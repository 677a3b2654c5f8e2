"""A rank lost during training (kill -9 of a peer, e.g. as a checkpoint starts): the survivors'
line naming it is the whole of their output (issue 62: about 100 lines of gloo traceback followed
it). launch/pretrain.py's own handling, with the collective's failure and the roll call's answer
stood in (the roll call itself: tests/test_preemption.py)."""
import sys
import types

import pytest

GLOO = "[../third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:29500: Connection reset by peer"


@pytest.mark.parametrize("note,raised", [
    ("a collective failed (Read error); rank 1 did not answer a roll call within 10 s: gone (on hostA: rank 1)",
     False),
    ("a collective failed (Read error); the rendezvous store (rank 0's, on hostA) cannot be reached: hostA is lost, "
     "or this host's link", False),
    # controls: a failure the line cannot explain keeps its traceback, and so does one that is no collective's
    ("a collective failed (Read error); every rank answered a roll call afterwards: a transient network error", True),
    (None, True),
])
def test_a_lost_rank_is_one_line_without_gloos_traceback(note, raised, tmp_path, monkeypatch, capsys):
    from megatron_kappa.cli import pretrain
    from megatron_kappa.parallel import failures

    def run(cfg, log):  # the checkpoint's first collective, after rank 1 was killed
        raise RuntimeError(GLOO)
    monkeypatch.setitem(sys.modules, "megatron_kappa.train.loop", types.SimpleNamespace(run=run))
    monkeypatch.setattr(failures, "explain", lambda e: note)
    monkeypatch.setattr(pretrain.preemption, "install", lambda: None)  # no handlers left in this process
    monkeypatch.setattr(pretrain.preemption, "watch_launcher", lambda: None)
    argv = ["--config", "configs/tiny.yaml", "--set", "data.mock=true", f"run.dir={tmp_path / 'run'}"]
    if raised:  # Python prints its traceback
        with pytest.raises(RuntimeError, match="Connection reset by peer"):
            pretrain.main(argv)
    else:
        assert pretrain.main(argv) == 1
    err = capsys.readouterr().err
    assert err == (f"error: rank 0: {note}\n" if note else ""), err
