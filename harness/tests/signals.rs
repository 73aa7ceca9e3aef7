//! A `strata-harness run` killed by a signal leaves no `strata serve` behind (issue 19, point 12): the servers it
//! starts die with it, and their engine workers with them.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The processes whose parent is `pid`, with their command lines.
fn children(pid: u32) -> Vec<(u32, String)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(child) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        // pid (comm) state ppid ...: the command may hold spaces and parentheses, so read after the last ')'.
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok());
        if ppid == Some(pid) {
            let cmd = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
            out.push((child, String::from_utf8_lossy(&cmd).replace('\0', " ")));
        }
    }
    out
}

fn alive(pid: u32) -> bool {
    // A zombie has exited: only its entry is left for its parent to read.
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z'))
    })
}

fn wait_for<T>(what: &str, limit: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(start.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Kills what it holds when dropped, so a failing test leaves nothing running either.
struct Reaper(Vec<u32>);

impl Drop for Reaper {
    fn drop(&mut self) {
        for &pid in &self.0 {
            // SAFETY: kill has no memory-safety preconditions.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
    }
}

fn killed_harness_leaves_no_server(signal: i32) {
    let dir = tempfile::tempdir().unwrap();
    let scenario = dir.path().join("long.yaml");
    // Enough requests that the server is still up when the signal comes.
    std::fs::write(
        &scenario,
        "name: long\nmodel: synth:tiny-qwen3moe\ndevice: cpu\nargs: [\"--max-context\", \"1024\"]\nrepetitions: 200\nmax_tokens: 200\ncases:\n  - name: a\n    prompt: {tokens: 300}\n",
    )
    .unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut harness = Command::new(env!("CARGO_BIN_EXE_strata-harness"))
        .arg("run")
        .arg(&scenario)
        .arg("--out")
        .arg(dir.path().join("out"))
        .current_dir(&root)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let hpid = harness.id();
    let mut reaper = Reaper(vec![hpid]);
    let (serve, _) = wait_for("the harness's strata serve", Duration::from_secs(300), || {
        children(hpid).into_iter().find(|(_, c)| c.contains(" serve "))
    });
    reaper.0.push(serve);
    let (worker, _) = wait_for("its engine worker", Duration::from_secs(120), || {
        children(serve).into_iter().find(|(_, c)| c.contains(" worker"))
    });
    reaper.0.push(worker);
    // SAFETY: kill has no memory-safety preconditions.
    assert_eq!(unsafe { libc::kill(hpid as i32, signal) }, 0);
    let _ = harness.wait();
    wait_for("the server to die with the harness", Duration::from_secs(10), || {
        (!alive(serve)).then_some(())
    });
    wait_for("the worker to die with the server", Duration::from_secs(30), || {
        (!alive(worker)).then_some(())
    });
}

#[test]
fn sigterm_to_the_harness_leaves_no_server() {
    killed_harness_leaves_no_server(libc::SIGTERM);
}

#[test]
fn sigkill_to_the_harness_leaves_no_server() {
    killed_harness_leaves_no_server(libc::SIGKILL);
}
