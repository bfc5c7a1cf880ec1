#!/usr/bin/env bash
# Mutation testing of sage_diffusers/reference/ and sage_diffusers/api.py with mutmut 3.
#
#   eval/mutation/run.sh                          # everything in setup.cfg
#   MUTATE="sage_diffusers/reference/quant.py" eval/mutation/run.sh   # one file first (faster)
#   TESTS="tests/test_quant_bitexact.py" eval/mutation/run.sh         # a narrower test selection
#
# Runs on a scratch checkout of HEAD (commit what you want measured); prints the survivors with
# their one-line changes and writes them, with mutmut's counts, to $MUTATION_OUT/mutation_survivors.txt
# (default eval/results/ of this checkout).
set -euo pipefail
repo="$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
work="${MUTATION_WORKDIR:-$(mktemp -d)/sage-mutation}"
git -C "$repo" worktree add --detach "$work" HEAD >/dev/null
trap 'git -C "$repo" worktree remove --force "$work"' EXIT
python - "$repo/eval/mutation/setup.cfg" "$work/setup.cfg" <<'PY'
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
mutmut run --max-children "${MUTATION_JOBS:-1}" >/dev/null 2>&1 || true
mutmut export-cicd-stats >/dev/null 2>&1 || true
mutmut results > results.txt 2>&1 || true
out="${MUTATION_OUT:-$repo/eval/results}"
python - "$out/mutation_survivors.txt" <<'PY'
import json, re, subprocess, sys
stats = json.load(open("mutants/mutmut-cicd-stats.json"))
lines = [l.strip() for l in open("results.txt").read().splitlines() if ": " in l]
report = [f"mutmut stats: {json.dumps(stats, sort_keys=True)}"]
for line in lines:  # every mutant that was not killed, with its one-line change
    diff = subprocess.run(["mutmut", "show", line.split(":")[0]], capture_output=True, text=True).stdout
    changed = [d for d in diff.splitlines() if re.match(r"^[-+][^-+]", d)]
    report.append(line + "\n    " + "\n    ".join(changed))
open(sys.argv[1], "w").write("\n".join(report) + "\n")
print("\n".join(report))
PY
