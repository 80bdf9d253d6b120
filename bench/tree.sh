#!/bin/bash
# Another commit's library and bench in .ab/REV (ignored by git; carry ".ab" to the GPU machine), for
# bench.suite's NAME@.ab/REV systems: two libraries in paired rounds on one machine.
#
#   bench/tree.sh 7614f57      -> .ab/7614f57/{deep_optimizer_states,bench,COMMIT}
set -eu
rev=${1:?usage: bench/tree.sh REV}
commit=$(git rev-parse --verify "$rev^{commit}")
dir=.ab/$rev
rm -rf "$dir" && mkdir -p "$dir"
git archive "$commit" deep_optimizer_states bench | tar -x -C "$dir"
echo "$commit" > "$dir/COMMIT"
echo "$dir: the library and bench of $commit"
