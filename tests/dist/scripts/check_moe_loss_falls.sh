#!/usr/bin/env bash
# check_moe_loss_falls.sh METRICS.jsonl
#
# The MoE char-LM run's JSON lines: every logged step carries the MoE fields (aux_loss, expert_load_min / _max), and
# the last logged loss is below 0.9 x the first (the model learns through the experts). Plain bash + awk.
set -euo pipefail
f="${1:?usage: $0 METRICS.jsonl}"
if [[ ! -s "$f" ]]; then
  echo "check_moe_loss_falls: '$f' is missing or empty" >&2
  exit 1
fi
awk '
  function value(line, key,    m) {
    if (!match(line, "\"" key "\":[-+0-9.eE]+")) return "";
    m = substr(line, RSTART, RLENGTH);
    return substr(m, length(key) + 4);
  }
  {
    loss = value($0, "loss");
    if (loss == "" || value($0, "aux_loss") == "" || value($0, "expert_load_min") == "" ||
        value($0, "expert_load_max") == "") {
      printf "check_moe_loss_falls: line %d lacks loss / aux_loss / expert_load_min / expert_load_max: %s\n", NR, $0;
      bad = 1; exit 1;
    }
    if (NR == 1) first = loss;
    last = loss;
    printf "step %s loss %s aux %s load %s/%s\n", value($0, "step"), loss, value($0, "aux_loss"),
           value($0, "expert_load_min"), value($0, "expert_load_max");
  }
  END {
    if (bad) exit 1;
    if (NR < 2 || !(last < 0.9 * first)) {
      printf "check_moe_loss_falls: the loss did not fall below 0.9 x %s (last %s, %d lines)\n", first, last, NR;
      exit 1;
    }
  }' "$f"
