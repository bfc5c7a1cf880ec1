#!/usr/bin/env bash
# Mutation testing of sage_diffusers/reference/ and the API (api.py and its private modules) with mutmut 3.
#
#   bench/mutation/run.sh                                              # everything in setup.cfg
#   MUTATE="sage_diffusers/reference/quant.py" bench/mutation/run.sh   # one file first (faster)
#   TESTS="tests/test_quant_bitexact.py" bench/mutation/run.sh         # a narrower test selection
#   MUTANTS="sage_diffusers._dispatch.*" SAMPLE=200 SEED=12 bench/mutation/run.sh   # a random sample
#
# Runs on a scratch checkout of HEAD (commit what you want measured); prints mutmut's counts per
# mutated file and every mutant that was not killed with its one-line change, and writes them to
# $MUTATION_OUT/mutation_survivors.txt (default eval/results/ of this checkout). With
# MUTATION_WORKDIR the checkout is kept there, so named mutants can be re-run in it afterwards
# (cd "$MUTATION_WORKDIR" && mutmut run NAME...).
set -euo pipefail
repo="$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
if [ -n "${MUTATION_WORKDIR:-}" ]; then
  work="$MUTATION_WORKDIR"
else
  work="$(mktemp -d)/sage-mutation"
  trap 'git -C "$repo" worktree remove --force "$work"' EXIT
fi
[ -d "$work" ] || git -C "$repo" worktree add --detach "$work" HEAD >/dev/null
python - "$repo/bench/mutation/setup.cfg" "$work/setup.cfg" <<'PY'
import os, sys
text = open(sys.argv[1]).read()
for key, env in (("only_mutate", "MUTATE"), ("pytest_add_cli_args_test_selection", "TESTS")):
    if os.environ.get(env):
        head, rest = text.split(f"{key}=\n", 1)
        body = rest.split("\n")
        i = next(n for n, line in enumerate(body) if not line.startswith("    "))
        text = head + f"{key}=\n" + "".join(f"    {p}\n" for p in os.environ[env].split()) + "\n".join(body[i:])
open(sys.argv[2], "w").write(text)
PY
cd "$work"
# mutmut's timeout is a CPU-time limit: torch's thread pool (spinning workers) would trip it on a
# loaded machine, and several mutmut children compete for the same cores anyway.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" MKL_NUM_THREADS="${MKL_NUM_THREADS:-1}"
jobs="${MUTATION_JOBS:-1}"
read -r -a names <<< "${MUTANTS:-}"
if [ -n "${SAMPLE:-}" ]; then
  # The first call generates the mutants and collects the test coverage, then stops at its empty
  # filter; the sample is drawn from the generated names (uniformly, reproducible with SEED).
  mutmut run --max-children "$jobs" "no-such-mutant" >/dev/null 2>&1 || true
  mapfile -t names < <(python - "$SAMPLE" "${SEED:-0}" "${names[@]}" <<'PY'
import fnmatch, glob, json, random, sys
n, seed, patterns = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:] or ["*"]
keys = sorted(k for f in glob.glob("mutants/**/*.py.meta", recursive=True)
              for k in json.load(open(f))["exit_code_by_key"]
              if any(fnmatch.fnmatch(k, p) for p in patterns))
print("\n".join(random.Random(seed).sample(keys, min(n, len(keys)))))
PY
  )
fi
mutmut run --max-children "$jobs" "${names[@]}" >/dev/null 2>&1 || true
out="${MUTATION_OUT:-$repo/eval/results}"
python "$repo/bench/mutation/report.py" "${names[@]}" | tee "$out/mutation_survivors.txt"
