#!/usr/bin/env bash
# Here, from the repo root: copies the whole tree of a branch (~4.5 MB) into .devsrc/NAME (ignored
# by git; carry it with `carry: [".devsrc"]`) so that one device call can build and measure it beside main.
#   bench/gpu/stage_branch.sh BRANCH [NAME (default: BRANCH)]
# Then, on the device: (cd .devsrc/NAME && bash bench/gpu/SCRIPT.sh "$OUT/NAME").
set -euo pipefail
branch=${1:?usage: stage_branch.sh BRANCH [NAME]}
name=${2:-$branch}
grep -qx '/.devsrc/' .git/info/exclude 2>/dev/null || echo '/.devsrc/' >>.git/info/exclude
rm -rf ".devsrc/$name"
mkdir -p ".devsrc/$name"
git archive "$branch" | tar -x -C ".devsrc/$name"
echo ".devsrc/$name: $(git rev-parse --short "$branch") ($(du -sh ".devsrc/$name" | cut -f1))"
