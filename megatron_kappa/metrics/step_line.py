"""The step line (one per logged step) and the line that ends a run, from a metrics.jsonl record.

    step 20/50 loss 5.1234 lr 3.00e-03 grad_norm 0.412 tokens/s 5210 rss 0.61 GiB 0:00:19 ETA 0:00:29
    step 25/50 ... 0:00:24 ETA 0:00:24 valid 4.9743 (4,096 tokens)
    step 20/50 loss 5.1234 lr 3.00e-03 grad_norm 0.412 tokens/s 1210000 TFLOP/s/GPU 412 MFU 41.7% mem 52.1/60.3 GiB ...
    done: step 50/50 in 0:00:48; checkpoint runs/tiny/checkpoints/step_50

The time is this start's (from its first step), the ETA the remaining steps at the last interval's
pace. TFLOP/s per GPU and MFU are printed on GPUs only (metrics.jsonl has them everywhere).
"""
from __future__ import annotations

from megatron_kappa.metrics.memory import memory_words


def clock(seconds: float) -> str:
    """h:mm:ss (days as hours: a long run's ETA stays one number)."""
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def step_line(record: dict, steps: int, on_gpu: bool, step_seconds: float) -> str:
    """`record`: a logged step's (loss, lr, grad_norm, tokens_per_s, the memory peaks, elapsed_s;
    valid_loss when the step validated); `step_seconds`: the last interval's time per step."""
    done = record["step"]
    speed = (f" TFLOP/s/GPU {record['tflops_per_gpu']:.3g}" + (f" MFU {record['mfu']:.1%}" if "mfu" in record else "")
             if on_gpu else "")
    return (f"step {done}/{steps} loss {record['loss']:.4f} lr {record['lr']:.2e} grad_norm {record['grad_norm']:.3f} "
            f"tokens/s {record['tokens_per_s']:.0f}{speed} {memory_words(record)} {clock(record['elapsed_s'])}"
            + (f" ETA {clock((steps - done) * step_seconds)}" if done < steps else "")
            + (f" valid {record['valid_loss']:.4f}" if "valid_loss" in record else "")
            # a sample of the validation data, not the whole split that eval/loss.py and the demo's
            # summary read: say how many tokens it averaged
            + (f" ({record['valid_tokens']:,} tokens)" if "valid_tokens" in record else ""))


def done_line(done: int, steps: int, elapsed_s: float, checkpoint) -> str:
    """The last line of a run that reached its last step (stopped and diverged runs end in their
    own line: train.preemption, train.divergence)."""
    return f"done: step {done}/{steps} in {clock(elapsed_s)}; " + (
        f"checkpoint {checkpoint}" if checkpoint else "no checkpoint (its last step was not saved)")
