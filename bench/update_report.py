"""Print the markdown tables of update-phase results: python bench/update_report.py docs/results/FILE.jsonl ..."""

import json
import sys

from deep_optimizer_states.tools.benchmark import table


def table_without_model(rows: list[dict]) -> str:
    """The first runs had no performance model yet: measured columns only."""
    lines = ["| schedule | staged | update s (median) | G params/s | CPU AdamW s | H2D GB | D2H GB | peak GPU GB "
             "| max rel. err vs torch |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['schedule']} | {r['staged']}/{r['subgroups']} | {r['update_s']:.3f} | "
                     f"{r['Gparams_per_s']:.2f} | {r['cpu_adam_s']:.3f} | {r['h2d_GB']} | {r['d2h_GB']} | "
                     f"{r['peak_gpu_GB']} | {r['max_rel_err_vs_torch']:.1e} |")
    return "\n".join(lines)


for path in sys.argv[1:]:
    rows = [json.loads(line) for line in open(path)]
    head = rows[0]
    best_k = min((r for r in rows if isinstance(r["schedule"], int)), key=lambda r: r["update_s"])
    auto = next((r for r in rows if r["schedule"] == "auto"), None)
    print(f"### {path}\n")
    print(f"{head['model']} ({head['params'] / 1e9:.2f}B params, {head['subgroups']} subgroups), {head['gpu']}, "
          f"torch {head['torch']}, {head['threads']} CPU threads; start-up (layout + pinning "
          f"{head['pinned_host_GB']} GB) {head['startup_s']} s; calibration {head.get('calibrate_s', '-')} s\n")
    print(table(rows) if "predicted_s" in head else table_without_model(rows))
    line = f"\nbest k: {best_k['schedule']} at {best_k['update_s']:.3f} s ({best_k['Gparams_per_s']:.2f} G params/s)"
    if auto:
        line += (f"; auto: {auto['staged']}/{auto['subgroups']} staged at {auto['update_s']:.3f} s "
                 f"({auto['update_s'] / best_k['update_s'] - 1:+.1%} against the best k)")
    if "lower_bound_s" in head:
        line += f"; lower bound from the calibrated rates: {head['lower_bound_s']:.3f} s"
    print(line + "\n")
