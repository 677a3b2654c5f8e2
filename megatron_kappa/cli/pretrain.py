"""Pre-train a κ-SwiGLU MoE.

    deepspeed launch/pretrain.py --config configs/sandwich28.yaml [--set key=value ...]
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 launch/pretrain.py --config configs/tiny.yaml
    python launch/pretrain.py --config configs/tiny.yaml --check 2 &&
        torchrun --nproc_per_node 2 launch/pretrain.py --config configs/tiny.yaml
    python launch/pretrain.py --config configs/tiny.yaml --set data.mock=true

Resumes from the latest checkpoint in run.dir. Bad configs and inputs exit with status 2 and one
line (megatron_kappa.preflight), before any process group is created or anything is written.
On SIGUSR1 or SIGTERM every rank finishes the step, a checkpoint is written and the process exits
with status 75 (megatron_kappa.train.preemption): the same command resumes. A collective that
fails (a dead or hung rank) is one line naming the ranks that no longer answer
(megatron_kappa.parallel.failures), status 1; the traceback follows only when every rank still
answered (a failure that line cannot explain).
"""
import argparse
import sys

from megatron_kappa.checkpoint.listing import CheckpointSaveError
from megatron_kappa.cli_types import positive_int
from megatron_kappa.config import ConfigError, load_config
from megatron_kappa.data.cache import DataCacheError
from megatron_kappa.parallel.launch_env import LaunchEnvError, exit_process, export_environment
from megatron_kappa.preflight import preflight
from megatron_kappa.train import preemption  # signals only: no heavy imports
from megatron_kappa.train.divergence import TrainingDiverged  # torch-free at import


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="YAML config (see docs/config.md)")
    ap.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                    help="config overrides, e.g. --set train.steps=100 parallel.ep=2")
    ap.add_argument("--check", type=positive_int, metavar="WORLD", default=None,
                    help="only check the config and its inputs for a launch of WORLD processes (the preflight: "
                         "no process group, nothing written) and exit: 0, or 2 with one line. Run it before "
                         "torchrun, which finds a bad config only once every rank has started")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.check is not None:
        try:
            preflight(load_config(args.config, args.set), world=args.check)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"ok: {args.config} checked for {args.check} process{'es' * (args.check > 1)}")
        return 0
    preemption.install()  # first: a warning during the slow start-up must not kill the process
    preemption.watch_launcher()  # and a rank never outlives its launcher
    rank, finished = 0, False
    try:
        found = export_environment()  # RANK & co. from torchrun/deepspeed, or from Slurm under srun
        rank = found.rank if found else 0
        cfg = load_config(args.config, args.set)
        preflight(cfg)
        from megatron_kappa.train.loop import run  # heavy imports only once the inputs are known good
        run(cfg, log=print if rank == 0 else (lambda *a, **k: None))
        finished = True
    except (ConfigError, LaunchEnvError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except CheckpointSaveError as e:  # every rank agreed the save failed; the previous one stands
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        finished = True
        return 1
    except DataCacheError as e:  # rank 0 writes the caches; the others end with it (not finished)
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    except TrainingDiverged as e:  # every rank read the same global numbers: all stop here
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        finished = True
        return 3
    except preemption.Preempted as e:
        preemption.ignore_from_now()  # the checkpoint is written: die of nothing until the exit
        if rank == 0:
            print(f"{e} (exit status {preemption.EXIT_RESUMABLE})", flush=True)
        finished = True  # every rank stops at the step they agreed on
        return preemption.EXIT_RESUMABLE
    except Exception as e:
        from megatron_kappa.parallel.failures import explain, names_the_lost
        note = explain(e)  # None unless a collective failed; else who did not answer
        if note:
            print(f"error: rank {rank}: {note}", file=sys.stderr, flush=True)
            if names_the_lost(note):  # the line says it all: no gloo traceback after it
                return 1
        raise
    finally:
        if "megatron_kappa.parallel.groups" in sys.modules:  # the groups exist only once training started
            sys.modules["megatron_kappa.parallel.groups"].teardown(peers_alive=finished)
    return 0


if __name__ == "__main__":
    exit_process(main())
