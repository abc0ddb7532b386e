//! The `racekv` command as the README uses it: `racekv up`, then redis-cli and `racekv`
//! against it, then Ctrl-C.

mod common;

use std::process::Command;

use common::Up;

#[test]
fn up_serves_redis_cli_and_the_cli_then_stops_on_ctrl_c() {
    let up = Up::start(&[]);
    let (redis, memnode, metrics, remote) = (up.redis, up.memnode, up.metrics, up.remote);
    assert!(up.banner.contains(&format!("redis-cli -p {redis} set greeting hello")), "{}", up.banner);
    let cli = |args: &[&str]| up.redis_cli(args);
    assert_eq!(cli(&["set", "a", "b"]), "OK");
    assert_eq!(cli(&["get", "a"]), "b");
    let racekv = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_racekv"))
            .args(args)
            .env("RACEKV_MEMNODES", format!("tcp:127.0.0.1:{memnode}"))
            .output()
            .unwrap();
        (out.status.success(), String::from_utf8_lossy(&out.stdout).trim().to_string())
    };
    assert_eq!(racekv(&["get", "a"]), (true, "b".to_string()));
    assert_eq!(racekv(&["put", "c", "d"]), (true, "OK".to_string()));
    // With no memnodes named, the CLI attaches to the local computenode (its default socket
    // lives in XDG_RUNTIME_DIR), and --remote goes through the remote front end.
    let other_mode = |args: &[&str]| up.racekv(args);
    let (ok, value, err) = other_mode(&["get", "c"]);
    assert!(ok && value == "d", "attached get: {value} {err}");
    let (ok, value, err) = other_mode(&["--version"]);
    assert!(ok, "{value} {err}");
    let (ok, _, err) = other_mode(&["put", "e", "f", "--remote", &format!("127.0.0.1:{remote}")]);
    assert!(ok, "remote put: {err}");
    assert_eq!(cli(&["get", "e"]), "f");
    assert_eq!(cli(&["get", "c"]), "d");
    let (ok, status) = racekv(&["status", "--computenode", &format!("127.0.0.1:{metrics}")]);
    assert!(ok && status.contains(&format!("computenode at 127.0.0.1:{metrics}: 1 worker")), "{status}");
    // Ctrl-C.
    let (clean, rest) = up.stop();
    assert!(clean, "racekv up did not exit cleanly: {rest}");
    assert!(rest.contains("stopped cleanly"), "{rest}");
}

#[test]
fn doctor_reports_and_names_fixes() {
    let out = Command::new(env!("CARGO_BIN_EXE_racekv")).arg("doctor").output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("memlock limit") && text.contains("huge pages"), "{text}");
    assert!(
        text.lines().all(|l| l.starts_with('[')
            || l.starts_with("       fix:")
            || l.starts_with("racekv ")
            || l.starts_with("the verbs")),
        "{text}"
    );
}

/// `racekv bench coldstart` starts `racekv get` both ways; each child must read the value
/// (the bench checks it) and report a stamp after its start.
#[test]
fn coldstart_bench_runs_children_in_both_modes() {
    let out = Command::new(env!("CARGO_BIN_EXE_racekv"))
        .args(["bench", "coldstart", "--runs", "2", "--json"])
        .env("RACEKV_LOG", "warn")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["runs"], 2);
    for field in ["attached_ms", "embedded_ms", "attached_p99_ms", "embedded_p99_ms"] {
        assert!(report[field].as_f64().unwrap() > 0.0, "{field}: {report}");
    }
}

/// `racekv bench spike` on shm, briefly: each new worker wakes, bootstraps and completes a
/// GET, in that order, in both modes; the JSON carries the figures docs/benchmarks.md cites.
#[test]
fn spike_bench_reports_each_new_workers_steps_in_both_modes() {
    let dir = tempfile::tempdir().unwrap();
    let plot = dir.path().join("spike.png");
    let out = Command::new(env!("CARGO_BIN_EXE_racekv"))
        .args(["bench", "spike", "--transport", "shm", "--workers-after", "3", "--trials", "1", "--keys", "1000"])
        .args(["--before-ms", "20", "--after-ms", "300", "--sample-us", "1000", "--json", "--plot"])
        .arg(&plot)
        .env("RACEKV_LOG", "warn")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for field in ["virtualized_bootstrap_ms", "fresh_bootstrap_ms", "virtualized_ready_max_ms", "fresh_ready_max_ms"] {
        assert!(report[field].as_f64().is_some_and(|v| v >= 0.0), "{field}: {report}");
    }
    let runs = report["runs"].as_array().unwrap();
    assert_eq!(runs.iter().map(|r| r["mode"].as_str().unwrap()).collect::<Vec<_>>(), ["virtualized", "fresh"]);
    for run in runs {
        let ms = |f: &str| run[f].as_f64().unwrap_or_else(|| panic!("{f}: {run}"));
        assert!(ms("plateau_ops_per_sec") > 0.0, "{run}");
        assert!(ms("woke_max_ms") <= ms("ready_max_ms") && ms("ready_max_ms") <= ms("first_op_max_ms"), "{run}");
    }
}

/// `racekv bench reclaim`, small: the restart finds what the crashed loader deleted (its
/// blocks were never given back) and the heap in use falls to the live bytes.
#[test]
fn reclaim_bench_finds_what_the_crashed_process_held() {
    let out = Command::new(env!("CARGO_BIN_EXE_racekv"))
        .args(["bench", "reclaim", "--keys", "5000", "--rounds", "1", "--json"])
        .env("RACEKV_LOG", "warn")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let bytes = |f: &str| report[f].as_u64().unwrap_or_else(|| panic!("{f}: {report}"));
    // Half of the 5000 keys (blocks of 2 units) were deleted and leaked.
    assert!(bytes("reclaimed_free_bytes") >= 2500 * 128, "{report}");
    assert_eq!(bytes("heap_used_bytes_after"), bytes("live_bytes"), "{report}");
    assert!(bytes("heap_used_bytes_before") >= bytes("heap_used_bytes_after") + 2500 * 128, "{report}");
    for field in ["reclaim_ms", "start_ms", "heap_scan_ms"] {
        assert!(report[field].as_f64().is_some_and(|v| v > 0.0), "{field}: {report}");
    }
}

/// The systemd install script stages binaries, units (which `systemd-analyze verify`
/// accepts), configs and a token shared by both daemons' env files (0640), and a second
/// run keeps what is there.
#[test]
fn the_systemd_install_script_stages_verified_units() {
    use std::os::unix::fs::PermissionsExt;
    let root = env!("CARGO_MANIFEST_DIR");
    let bin_dir = std::path::Path::new(env!("CARGO_BIN_EXE_racekv")).parent().unwrap().to_path_buf();
    if !bin_dir.join("racekv-memnode").exists() || !bin_dir.join("racekv-computenode").exists() {
        panic!("the daemons are not built in {}: run cargo test --workspace", bin_dir.display());
    }
    let stage = tempfile::tempdir().unwrap();
    let install = || {
        let out = Command::new("bash")
            .arg(format!("{root}/ops/systemd/install.sh"))
            .args(["--root".as_ref(), stage.path().as_os_str(), "--bin-dir".as_ref(), bin_dir.as_os_str()])
            .arg("--no-start")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    };
    install();
    let path = |p: &str| stage.path().join(p);
    for bin in ["racekv", "racekv-memnode", "racekv-computenode"] {
        assert!(path(&format!("usr/local/bin/{bin}")).exists(), "{bin}");
    }
    for unit in ["racekv-memnode.service", "racekv-computenode.service"] {
        let text = std::fs::read_to_string(path(&format!("etc/systemd/system/{unit}"))).unwrap();
        assert!(text.contains("Type=notify"), "{unit}");
    }
    let token = |daemon: &str| {
        let file = path(&format!("etc/racekv/{daemon}.env"));
        assert_eq!(std::fs::metadata(&file).unwrap().permissions().mode() & 0o777, 0o640, "{daemon}.env");
        let text = std::fs::read_to_string(file).unwrap();
        text.trim().split_once('=').unwrap().1.to_string()
    };
    let first = token("memnode");
    assert_eq!(first.len(), 64);
    assert_eq!(token("computenode"), first, "one token for both");
    std::fs::write(path("etc/racekv/memnode.toml"), "region_bytes = 1024\n").unwrap();
    install();
    assert_eq!(token("memnode"), first, "a second run keeps the token");
    assert_eq!(std::fs::read_to_string(path("etc/racekv/memnode.toml")).unwrap(), "region_bytes = 1024\n");
}

/// `racekv up --replicas` needs the etcd build; without it, it says how to get one and
/// starts nothing.
#[cfg(not(feature = "etcd"))]
#[test]
fn up_with_replicas_says_how_to_get_an_etcd_build() {
    let out =
        Command::new(env!("CARGO_BIN_EXE_racekv")).args(["up", "--memnodes", "3", "--replicas", "1"]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--features etcd"), "{err}");
}
