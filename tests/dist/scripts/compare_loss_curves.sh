#!/usr/bin/env bash
# compare_loss_curves.sh RTOL REFERENCE.jsonl OTHER.jsonl...
#
# Compares the loss curves that train_char_lm writes as JSON lines ({"loss": ..., "step": ...} per logged step): every
# file must log the same steps, and at each step |loss - loss_ref| <= RTOL · |loss_ref|. Prints the curves side by side
# with the largest relative difference per step; exits 1 on a mismatch, a missing or empty file, or differing steps.
# Plain bash + awk, no other dependency.
set -euo pipefail
if [[ $# -lt 3 ]]; then
  echo "usage: $0 RTOL REFERENCE.jsonl OTHER.jsonl..." >&2
  exit 2
fi
rtol="$1"
shift
for f in "$@"; do
  if [[ ! -s "$f" ]]; then
    echo "compare_loss_curves: '$f' is missing or empty" >&2
    exit 1
  fi
done
awk -v rtol="$rtol" '
  function value(line, key,    m) {
    if (!match(line, "\"" key "\":[-+0-9.eE]+")) return "";
    m = substr(line, RSTART, RLENGTH);
    return substr(m, length(key) + 4);
  }
  FNR == 1 { nfiles++; names[nfiles] = FILENAME }
  {
    step = value($0, "step"); loss = value($0, "loss");
    if (step == "" || loss == "") {
      printf "compare_loss_curves: %s:%d has no step or loss: %s\n", FILENAME, FNR, $0 > "/dev/stderr"
      bad = 1; next
    }
    if (nfiles == 1) { order[++nsteps] = step }
    loss_of[nfiles, step] = loss; count[nfiles]++
  }
  END {
    if (bad) exit 1
    for (f = 2; f <= nfiles; f++) {
      if (count[f] != nsteps) {
        printf "compare_loss_curves: %s logs %d steps, %s logs %d\n", names[f], count[f], names[1], nsteps
        exit 1
      }
    }
    printf "%6s", "step"
    for (f = 1; f <= nfiles; f++) {
      n = names[f]; sub(/.*\//, "", n); w = length(n) > 16 ? length(n) : 16
      col[f] = " | %" w ".9f"; printf " | %" w "s", n
    }
    printf " | %s\n", "max rel diff"
    worst = 0; failed = 0
    for (i = 1; i <= nsteps; i++) {
      step = order[i]; ref = loss_of[1, step] + 0; row = 0
      printf "%6d" col[1], step, ref
      for (f = 2; f <= nfiles; f++) {
        if (!((f, step) in loss_of)) { printf "\ncompare_loss_curves: %s has no step %s\n", names[f], step; exit 1 }
        l = loss_of[f, step] + 0; d = l - ref; if (d < 0) d = -d; a = ref < 0 ? -ref : ref
        rel = a > 0 ? d / a : d
        if (rel > row) row = rel
        printf col[f], l
      }
      printf " | %.2e%s\n", row, (row > rtol ? "  > rtol" : "")
      if (row > rtol) failed++
      if (row > worst) worst = row
    }
    printf "compare_loss_curves: %d files, %d steps, max relative difference %.2e (rtol %g): %s\n",
           nfiles, nsteps, worst, rtol, (failed ? "FAILED" : "the curves agree")
    exit failed ? 1 : 0
  }
' "$@"
