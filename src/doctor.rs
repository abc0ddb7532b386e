//! `racekv doctor`: checks what this host needs to run racekv over RDMA (and what it has
//! instead), and says what to fix.

use std::fmt::Write as _;

/// One finding: fine, worth a look, or a problem, with what to do.
struct Finding {
    level: Level,
    what: String,
    fix: Option<String>,
}

#[derive(PartialEq, Eq, PartialOrd, Ord, Clone, Copy)]
enum Level {
    Ok,
    Warn,
    // Only the RDMA checks can fail outright.
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    Fail,
}

fn ok(what: impl Into<String>) -> Finding {
    Finding { level: Level::Ok, what: what.into(), fix: None }
}

fn warn(what: impl Into<String>, fix: impl Into<String>) -> Finding {
    Finding { level: Level::Warn, what: what.into(), fix: Some(fix.into()) }
}

#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
fn fail(what: impl Into<String>, fix: impl Into<String>) -> Finding {
    Finding { level: Level::Fail, what: what.into(), fix: Some(fix.into()) }
}

#[cfg(feature = "rdma")]
fn rdma_devices(findings: &mut Vec<Finding>) {
    match racekv_transport::verbs::devices() {
        Ok(devices) if !devices.is_empty() => {
            for d in devices {
                let active: Vec<_> = d.ports.iter().filter(|p| p.active).collect();
                let mut text = format!("RDMA device {} (atomics: {})", d.name, d.atomic_cap);
                for p in &d.ports {
                    let _ = write!(text, "; port {} {} {} mtu {} with {} GID(s)", p.port, if p.active { "ACTIVE" } else { "down" }, p.link_layer, p.mtu, p.gids.len());
                }
                if active.is_empty() {
                    findings.push(warn(text, format!("bring a port of {} up (cable, link, `ip link set <netdev> up`)", d.name)));
                } else if active.iter().all(|p| p.gids.is_empty()) {
                    findings.push(warn(text, "the active ports have no GID: give their network interface an IP address"));
                } else {
                    findings.push(ok(text));
                }
            }
        }
        Ok(_) => findings.push(fail(
            "no RDMA device (verbs transport unavailable)",
            "on a machine with an RDMA NIC load its driver; without one, create a Soft-RoCE device: `modprobe rdma_rxe && rdma link add rxe0 type rxe netdev <if>`; or use the shm (same host) or tcp transports",
        )),
        Err(e) => findings.push(fail(format!("cannot list RDMA devices: {e}"), "install rdma-core and ibverbs-providers; check /dev/infiniband permissions")),
    }
}

#[cfg(not(feature = "rdma"))]
fn rdma_devices(findings: &mut Vec<Finding>) {
    let sys = std::path::Path::new("/sys/class/infiniband");
    let names: Vec<String> = std::fs::read_dir(sys)
        .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    let seen = if names.is_empty() {
        "the kernel lists no RDMA device".to_string()
    } else {
        format!("the kernel lists RDMA device(s) {}", names.join(", "))
    };
    findings.push(warn(
        format!("this racekv was built without RDMA support; {seen}"),
        "rebuild with `cargo build --release --features rdma` (needs libibverbs-dev, librdmacm-dev, libclang-dev, pkg-config) to use verbs; shm and tcp work as built",
    ));
}

fn memlock(findings: &mut Vec<Finding>) {
    use nix::sys::resource::{getrlimit, Resource, RLIM_INFINITY};
    match getrlimit(Resource::RLIMIT_MEMLOCK) {
        Ok((soft, _)) if soft == RLIM_INFINITY => findings.push(ok("memlock limit: unlimited")),
        Ok((soft, hard)) => findings.push(warn(
            format!("memlock limit: {} KiB (hard {} KiB)", soft / 1024, if hard == RLIM_INFINITY { "unlimited".to_string() } else { (hard / 1024).to_string() }),
            "a verbs memnode registers its whole region: raise it (`ulimit -l unlimited`, LimitMEMLOCK=infinity in systemd, or /etc/security/limits.conf)",
        )),
        Err(e) => findings.push(warn(format!("cannot read the memlock limit: {e}"), "check `ulimit -l`")),
    }
}

fn meminfo(key: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    text.lines().find(|l| l.starts_with(key)).and_then(|l| l.split_whitespace().nth(1)).and_then(|v| v.parse().ok())
}

fn huge_pages(findings: &mut Vec<Finding>) {
    match (meminfo("HugePages_Total:"), meminfo("HugePages_Free:"), meminfo("Hugepagesize:")) {
        (Some(0), _, Some(size)) => findings.push(warn(
            format!("huge pages: none reserved ({size} KiB pages)"),
            "for `--huge-pages` regions reserve them: `sysctl vm.nr_hugepages=<region bytes / page size>` (regions on 4 KiB pages work, with more TLB misses)",
        )),
        (Some(total), Some(free), Some(size)) => findings.push(ok(format!("huge pages: {free} of {total} free ({size} KiB each, {} MiB free)", free * size / 1024))),
        _ => findings.push(warn("huge pages: cannot read /proc/meminfo", "check /proc/meminfo")),
    }
    if let Ok(thp) = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled") {
        findings.push(ok(format!("transparent huge pages: {}", thp.trim())));
    }
}

fn shared_memory(findings: &mut Vec<Finding>) {
    match nix::sys::statvfs::statvfs("/dev/shm") {
        Ok(s) => findings.push(ok(format!("/dev/shm: {} MiB free", (s.blocks_available() * s.fragment_size()) >> 20))),
        Err(e) => findings.push(warn(format!("/dev/shm: {e}"), "mount a tmpfs on /dev/shm for same-host tools")),
    }
}

pub fn run() -> anyhow::Result<()> {
    let mut findings = Vec::new();
    rdma_devices(&mut findings);
    memlock(&mut findings);
    huge_pages(&mut findings);
    shared_memory(&mut findings);
    let mut out = String::new();
    for f in &findings {
        let tag = match f.level {
            Level::Ok => "ok  ",
            Level::Warn => "warn",
            Level::Fail => "FAIL",
        };
        let _ = writeln!(out, "[{tag}] {}", f.what);
        if let Some(fix) = &f.fix {
            let _ = writeln!(out, "       fix: {fix}");
        }
    }
    let worst = findings.iter().map(|f| f.level).max().unwrap_or(Level::Ok);
    print!("{out}");
    println!(
        "{}",
        match worst {
            Level::Ok => "racekv can use every transport on this host.",
            Level::Warn => "racekv runs here; see the warnings for what limits it.",
            Level::Fail => "the verbs transport cannot run here as things are; shm and tcp can.",
        }
    );
    Ok(())
}
