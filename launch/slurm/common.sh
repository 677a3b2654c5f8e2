# Shared by launch/slurm/*.sbatch (sourced from the batch shell; not a job script itself).
#
# Inputs (environment): SLURM_* from sbatch; optional PYTHON, LAUNCHER (srun | deepspeed),
# MASTER_PORT, KAPPA_ROOT (repository root; default $SLURM_SUBMIT_DIR), SRUN_ARGS / DS_ARGS
# (extra words for srun / the deepspeed runner).

kappa_die() { echo "error: $*" >&2; exit 2; }

# cd to the repository root and pick the Python interpreter.
kappa_setup() {
    [ -n "${SLURM_JOB_ID:-}" ] || kappa_die "submit this script with sbatch (SLURM_JOB_ID is not set)"
    KAPPA_ROOT=${KAPPA_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}
    cd "$KAPPA_ROOT" || kappa_die "cannot cd to $KAPPA_ROOT"
    [ -d megatron_kappa ] && [ -d launch ] ||
        kappa_die "$KAPPA_ROOT is not the repository root: submit from it (or set KAPPA_ROOT)"
    if [ -z "${PYTHON:-}" ]; then
        if [ -x .venv/bin/python ]; then PYTHON=$KAPPA_ROOT/.venv/bin/python; else PYTHON=python; fi
    fi
    export PYTHON PYTHONUNBUFFERED=1
    # the repository's packages (eval/, data_prep/, launch/) import from the root
    export PYTHONPATH="$KAPPA_ROOT${PYTHONPATH:+:$PYTHONPATH}"
    # Slurm 22.05's srun no longer reads SLURM_CPUS_PER_TASK (23.11 does again): pass it on.
    if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK; fi
}

# Rendezvous: first host of the job, a port from the job id (launch_env.slurm_port's formula).
# RANK / LOCAL_RANK / WORLD_SIZE are unset: each srun task derives them from SLURM_PROCID etc.
# (megatron_kappa/parallel/launch_env.py); left over from the submitting shell they would give
# every task the same rank.
kappa_rendezvous() {
    local hosts
    hosts=$(scontrol show hostnames "$SLURM_JOB_NODELIST" 2>/dev/null) || hosts=""
    if [ -z "$hosts" ]; then  # no scontrol here: launch_env's parser of node[01-04,07] forms
        hosts=$("$PYTHON" -c 'import sys; from megatron_kappa.parallel.launch_env import expand_hostlist
print("\n".join(expand_hostlist(sys.argv[1])))' "$SLURM_JOB_NODELIST") ||
            kappa_die "cannot expand the node list $SLURM_JOB_NODELIST"
    fi
    KAPPA_HOSTS=$hosts
    export MASTER_ADDR=${KAPPA_HOSTS%%$'\n'*}
    export MASTER_PORT=${MASTER_PORT:-$((10000 + SLURM_JOB_ID % 20000))}
    unset RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE GROUP_RANK ROLE_RANK CROSS_RANK
}

# Copy everything the batch shell and its steps print into $1 as well (appending: a requeued
# job continues its log). The copy is a tee that ignores TERM/INT/HUP/USR1, so that the last
# lines written after a cancel or requeue still arrive; it exits when the job's output closes.
kappa_log_to() {
    local log=$1
    if ! mkdir -p "$(dirname "$log")"; then
        echo "warning: cannot create $(dirname "$log"): the job's output stays in Slurm's --output only" >&2
        return 0
    fi
    exec > >(trap '' TERM INT HUP USR1 USR2; exec tee -a "$log") 2>&1
    KAPPA_TEE_PID=$!
    KAPPA_LOG=$log
}

# Close our output and wait for the tee to write it all, then exit with $1.
kappa_exit() {
    local rc=$1
    if [ -n "${KAPPA_TEE_PID:-}" ]; then
        exec >&- 2>&-
        wait "$KAPPA_TEE_PID" 2>/dev/null || true
    fi
    exit "$rc"
}

kappa_banner() {
    echo "=== $(date '+%F %T') job $SLURM_JOB_ID (${SLURM_JOB_NAME:-}) restart ${SLURM_RESTART_COUNT:-0}:" \
         "${SLURM_JOB_NUM_NODES:-1} node(s) [${SLURM_JOB_NODELIST}], ${SLURM_NTASKS:-?} task(s)," \
         "rendezvous $MASTER_ADDR:$MASTER_PORT, launcher ${LAUNCHER:-srun}"
    echo "=== $*"
    [ -n "${KAPPA_LOG:-}" ] && echo "=== log: $KAPPA_LOG"
    return 0
}

# GPUs per node of this job (SLURM_GPUS_PER_NODE may read "4" or "h100:4"); 0 if none asked.
kappa_gpus_per_node() {
    local g=${SLURM_GPUS_PER_NODE:-0}
    g=${g##*:}
    g=${g%%(*}
    [[ $g =~ ^[0-9]+$ ]] || g=0
    echo "$g"
}

# SIGTERM to the batch shell means Slurm is ending the job (scancel, scontrol requeue, preemption
# or the time limit) and decides itself whether it comes back. The ranks got it too and are
# writing a checkpoint (megatron_kappa.train.preemption): the shell must not die before them
# (its death would end the job step). With a trap, bash runs it once the running srun returns.
kappa_term_waits() {
    KAPPA_TERMINATED=""
    trap 'KAPPA_TERMINATED=1' TERM
}

# After the ranks stopped on the warning signal with a checkpoint (exit status 75) and Slurm is
# not ending the job already: requeue it (same job id; it resumes from the checkpoint), unless
# REQUEUE=0 or the job was submitted with --no-requeue; then the same sbatch command resumes.
kappa_requeue() {
    if [ "${REQUEUE:-1}" = 0 ]; then
        echo "=== $(date '+%F %T') job $SLURM_JOB_ID: checkpointed; REQUEUE=0: resubmit to resume"
        return 0
    fi
    echo "=== $(date '+%F %T') job $SLURM_JOB_ID: checkpointed on the warning signal: scontrol requeue $SLURM_JOB_ID"
    if ! scontrol requeue "$SLURM_JOB_ID"; then
        echo "warning: the requeue was refused (submitted with --no-requeue?): resubmit the same command to resume" >&2
    fi
}

# Variables passed to the ranks the deepspeed runner starts on other nodes (one word values only:
# the runner writes `export NAME=VALUE;` unquoted).
KAPPA_DS_ENV='^(DS_ACCELERATOR|MEGATRON_KAPPA_[A-Z_]+|OMP_NUM_THREADS|TORCH[A-Z_]*|TRITON_[A-Z_]+|GLOO_[A-Z_]+|CUDA_[A-Z_]+|HF_[A-Z_]+|KAPPA_RUN_DIR)=[^ ]*$'

# Run "$@" (a Python script and its arguments) on every rank and return its status.
#   LAUNCHER=srun (default): one srun task per GPU (per --ntasks-per-node), all on the job's
#     nodes; each task finds its rank in SLURM_PROCID / SLURM_LOCALID / SLURM_NTASKS.
#   LAUNCHER=deepspeed: the deepspeed runner, once, on the first node, as a one-task step, with a
#     hostfile of the job's nodes (slots = GPUs per node, else tasks per node); it starts the
#     local ranks itself and the other nodes' through its multi-node launcher (pdsh by default:
#     needs passwordless ssh; DS_ARGS="--launcher ..." to change). The runner ignores USR1 so
#     that Slurm's --signal=USR1@T, which reaches every process of the step, leaves it running
#     for the ranks (which inherit "ignore" and must install their own handler) to act on.
#     With several nodes the other nodes' ranks get KAPPA_DS_ENV's variables (DS_ENV_FILE).
kappa_launch() {
    local launcher=${LAUNCHER:-srun}
    case $launcher in
    srun)
        # shellcheck disable=SC2086
        srun --kill-on-bad-exit=1 --export=ALL ${SRUN_ARGS:-} "$PYTHON" -u "$@"
        ;;
    deepspeed)
        local slots hostfile h nhosts=0 check=()
        slots=$(kappa_gpus_per_node)
        [ "$slots" -gt 0 ] || slots=${SLURM_NTASKS_PER_NODE:-1}
        slots=${slots%%(*}
        hostfile=$(mktemp "${TMPDIR:-/tmp}/kappa-hostfile-$SLURM_JOB_ID.XXXXXX") ||
            kappa_die "cannot write a hostfile in ${TMPDIR:-/tmp}"
        # removed on every exit, scancel / requeue (SIGTERM to this shell) included
        # shellcheck disable=SC2064
        trap "rm -f '$hostfile'" EXIT
        # without a TERM trap bash dies of TERM without running the EXIT trap; pretrain.sbatch
        # has its own (kappa_term_waits)
        [ -n "$(trap -p TERM)" ] || trap 'exit 143' TERM
        while read -r h; do
            [ -n "$h" ] && echo "$h slots=$slots" >> "$hostfile" && nhosts=$((nhosts + 1))
        done <<< "$KAPPA_HOSTS"
        echo "=== hostfile $hostfile:"; cat "$hostfile"
        # one node: the runner starts the ranks itself, its ssh check would only get in the way
        [ "$nhosts" -gt 1 ] || check=(--no_ssh_check)
        # several: the other nodes' ranks start from pdsh/ssh with a bare environment and the
        # runner passes on only NCCL_*, PYTHON* and its environment file: give it one with the
        # variables that decide what a rank does, after the user's own .deepspeed_env lines
        if [ "$nhosts" -gt 1 ]; then
            local envfile
            envfile=$(mktemp "${TMPDIR:-/tmp}/kappa-dsenv-$SLURM_JOB_ID.XXXXXX") ||
                kappa_die "cannot write a DeepSpeed environment file in ${TMPDIR:-/tmp}"
            # shellcheck disable=SC2064
            trap "rm -f '$hostfile' '$envfile'" EXIT
            { for f in "$HOME/.deepspeed_env" ./.deepspeed_env; do [ -f "$f" ] && grep '=' "$f"; done
              env | grep -E "$KAPPA_DS_ENV" || true
            } > "$envfile"
            export DS_ENV_FILE=$envfile
            echo "=== environment for the other nodes' ranks ($envfile): $(cut -d= -f1 "$envfile" | tr '\n' ' ')"
        fi
        # --whole: the runner's step gets all of the job's CPUs, GPUs and memory on the first node
        # shellcheck disable=SC2086
        srun --nodes=1 --ntasks=1 --whole --kill-on-bad-exit=1 --export=ALL ${SRUN_ARGS:-} \
            bash -c 'trap "" USR1; exec "$@"' kappa-deepspeed \
            "$PYTHON" -u -m deepspeed.launcher.runner --hostfile "$hostfile" "${check[@]}" \
            --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" ${DS_ARGS:-} "$@"
        ;;
    *)
        kappa_die "LAUNCHER=$launcher: expected srun or deepspeed"
        ;;
    esac
}
