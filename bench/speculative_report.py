"""``bench/speculative.py``'s report: each speculative row against plain decoding, the targets,
and the printed summary."""

from __future__ import annotations


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


def format_turns(row: dict) -> str:
    head = (
        f"{row['rtt_ms']:>5} multi-turn ({row['turn1_prompt_tokens']} then {row['turn2_prompt_tokens']} prompt "
        f"tokens): TTFT turn 1 {seconds(row['turn1_ttft_s'])}, turn 2 without reuse "
        f"{seconds(row['turn2_no_reuse_ttft_s'])}"
    )
    if not row["prefix_reuse"]:
        return head + "; prefix reuse not available (GenerationRequest has no prefix_salt in this checkout)"
    identical = {None: "-", True: "yes", False: "NO"}[row["identical"]]
    return (
        f"{head}, turn 2 with reuse {seconds(row['turn2_ttft_s'])} (cached {row['turn2_cached_tokens']} tokens); "
        f"turn 2 / turn 1 {row['turn2_over_turn1']}; identical to turn 2 without reuse: {identical}"
    )


def compare(rows: list[dict]) -> list[dict]:
    """Each speculative row against plain decoding at the same round trip, prompts, streams and sampling."""

    def key(row: dict) -> tuple:
        return row["rtt_ms"], row["prompts"], row["streams"], row["sampling"]

    plain = {key(r): r for r in rows if r["mode"] == "plain"}
    out = []
    for row in rows:
        base = plain.get(key(row))
        if row["mode"] == "plain" or base is None:
            continue
        out.append(
            {
                "rtt_ms": row["rtt_ms"],
                "mode": row["mode"],
                "prompts": row["prompts"],
                "streams": row["streams"],
                "sampling": row["sampling"],
                "plain_tok_s": base["tok_s"],
                "tok_s": row["tok_s"],
                "ratio": round(row["tok_s"] / base["tok_s"], 2) if row["tok_s"] and base["tok_s"] else None,
                "acceptance": row["acceptance"],
                "tokens_per_pass": row["tokens_per_pass"],
                "lookup_tokens_per_pass": row["lookup_tokens_per_pass"],
                "wasted_positions": row["wasted_positions"],
                "identical": row["token_ids"] == base["token_ids"],
                "plans": row["plans"],
            }
        )
        if "per_prompt" in row:
            out[-1]["per_prompt_ratio"] = [
                round(mine["tok_s"] / theirs["tok_s"], 2) if mine["tok_s"] and theirs["tok_s"] else None
                for mine, theirs in zip(row["per_prompt"], base["per_prompt"], strict=True)
            ]
    return out


def targets(comparisons: list[dict], turns: list[dict]) -> list[dict]:
    """The goals, each with the figure that decides it (None: not measured in this run)."""

    def check(name: str, value: float | None, relation: str, goal: float, where: str = "") -> dict:
        met = None
        if value is not None:
            met = value >= goal if relation == ">=" else value <= goal if relation == "<=" else value == goal
        return {"target": name, "value": value, "relation": relation, "goal": goal, "met": met, "where": where}

    auto = [c for c in comparisons if c["mode"] == "auto"]

    def at_300(kind: str) -> float | None:
        wanted = (300, 1, "greedy", kind)
        return next(
            (c["ratio"] for c in auto if (c["rtt_ms"], c["streams"], c["sampling"], c["prompts"]) == wanted), None
        )

    def lowest(kinds: tuple[str, ...]) -> tuple[float | None, str]:
        measured = [c for c in auto if c["prompts"] in kinds and c["ratio"] is not None]
        if not measured:
            return None, ""
        low = min(measured, key=lambda c: c["ratio"])
        streams = f"{low['streams']} stream" + ("s" if low["streams"] != 1 else "")
        return low["ratio"], f"{low['prompts']} at {low['rtt_ms']} ms, {streams}, {low['sampling']}"

    greedy = [c for c in auto if c["sampling"] == "greedy"]
    novel_low, novel_where = lowest(("novel",))
    draftable_low, draftable_where = lowest(("draftable", "long"))
    reused = [t for t in turns if t["turn2_over_turn1"] is not None]
    compared = [t for t in turns if t["identical"] is not None]
    slowest = max(reused, key=lambda t: t["turn2_over_turn1"]) if reused else None
    unavailable = "prefix reuse not available" if turns and not reused else ""
    return [
        check("short draftable at 300 ms, 1 stream, greedy: speculative / plain", at_300("draftable"), ">=", 10.0),
        check("long passage at 300 ms, 1 stream, greedy: speculative / plain", at_300("long"), ">=", 10.0),
        check("novel chat at 300 ms, 1 stream, greedy: speculative / plain", at_300("novel"), ">=", 1.0),
        check("novel chat, lowest ratio over every row", novel_low, ">=", 0.98, novel_where),
        check("draftable (short and long), lowest ratio over every row", draftable_low, ">=", 1.0, draftable_where),
        check(
            "greedy rows whose tokens differ from plain decoding",
            sum(not c["identical"] for c in greedy) if greedy else None,
            "==",
            0,
            f"of {len(greedy)}" if greedy else "",
        ),
        check(
            "multi-turn: turn-2 TTFT with prefix reuse / turn-1 TTFT (highest over the round trips)",
            slowest and slowest["turn2_over_turn1"],
            "<=",
            0.3,
            f"{slowest['rtt_ms']} ms" if slowest else unavailable,
        ),
        check(
            "multi-turn: turn-2 outputs with reuse that differ from the same prompt without",
            sum(not t["identical"] for t in compared) if compared else None,
            "==",
            0,
            unavailable,
        ),
    ]


def print_summary(comparisons: list[dict], turns: list[dict], checks: list[dict], *, quick: bool) -> None:
    print(
        f"\n{'RTT ms':>6} {'prompts':<10} {'sampling':<8} {'streams':>7} {'plain tok/s':>11} {'spec tok/s':>10} "
        f"{'ratio':>6} {'accept':>6} {'tok/pass':>8} {'lookup':>6} {'wasted':>6} {'identical':>9}  "
        "router's plans (chains)"
    )
    for c in comparisons:
        acceptance = "-" if c["acceptance"] is None else f"{c['acceptance']:.2f}"
        plans = ", ".join(f"{name}: {count}" for name, count in list(c["plans"].items())[:3])
        identical = "yes" if c["identical"] else "NO" if c["sampling"] == "greedy" else "no"
        print(
            f"{c['rtt_ms']:>6} {c['prompts']:<10} {c['sampling']:<8} {c['streams']:>7} {c['plain_tok_s'] or 0:>11.2f} "
            f"{c['tok_s'] or 0:>10.2f} {c['ratio'] or 0:>6.2f} {acceptance:>6} {c['tokens_per_pass']:>8.2f} "
            f"{c['lookup_tokens_per_pass']:>6.2f} {c['wasted_positions']:>6} {identical:>9}  {plans}"
        )
        if "per_prompt_ratio" in c:
            print(f"{'':>6} each prompt alone: ratios {c['per_prompt_ratio']}")
    print(
        "ratio: speculative / plain decode tok/s at the same round trip (every link delayed by half of it); "
        "drafter: n-gram prompt lookup (no offline draft model shares SmolLM2's tokenizer); lookup: tokens per "
        "pass of ideal prompt lookup on the same answers (unlimited K), the ceiling of any n-gram plan; identical is "
        "required of greedy rows only (sampled: seeded, lossless in distribution, tests/test_speculation_sampling.py)"
    )
    for turn in turns:
        print(format_turns(turn))
    print(
        "\ntargets"
        + (" (--quick: too few tokens for the router to start; these check the code paths)" if quick else "")
    )
    for check in checks:
        verdict = "n/a" if check["met"] is None else "PASS" if check["met"] else "MISS"
        where = f" [{check['where']}]" if check["where"] else ""
        print(f"  {verdict:<4} {check['target']}: {check['value']} (goal {check['relation']} {check['goal']}){where}")
