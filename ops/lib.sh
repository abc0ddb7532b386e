# Shared by the scripts in ops/ (sourced, not run).

# racekv_work_dir: a temporary directory in $work and an empty $pids; on exit every pid in
# $pids is killed and waited for, and $work removed.
racekv_work_dir() {
    work=$(mktemp -d)
    pids=()
    trap racekv_clean_work_dir EXIT
}

racekv_clean_work_dir() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$work"
}

# racekv_ab_rounds ROUNDS RUN: A/B in alternating order (A, B; B, A; ...). `RUN A` and `RUN B`
# each print one run's requests/s, optionally followed by more figures; prints each round,
# then the geometric mean of the rounds' B / A throughput ratios (each round's two runs are
# back to back: the estimate a shared host's drift disturbs least).
racekv_ab_rounds() {
    local rounds=$1 run=$2 r a b ratios=()
    for (( r = 1; r <= rounds; r++ )); do
        if (( r % 2 == 1 )); then a=$("$run" A); b=$("$run" B); else b=$("$run" B); a=$("$run" A); fi
        echo "round $r: A $a; B $b"
        ratios+=("$(awk -v x="${a%% *}" -v y="${b%% *}" 'BEGIN {print y / x}')")
    done
    python3 -c "import statistics, sys; print('B / A throughput, geometric mean of the rounds:', round(statistics.geometric_mean(map(float, sys.argv[1:])), 3))" "${ratios[@]}"
}
