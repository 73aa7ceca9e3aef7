//! `strata generate` and `strata chat` as a user runs them: the binary, its stdout (the text) and stderr (the
//! summary line), on the default model from the cache.

use std::io::Write;
use std::process::{Command, Output, Stdio};

use strata_engine::models;

fn strata() -> Command {
    // Fail early, naming the fetch command, when the cache is empty.
    models::require(models::DEFAULT_MODEL_FILE).unwrap_or_else(|e| panic!("{e}"));
    Command::new(env!("CARGO_BIN_EXE_strata"))
}

fn run(args: &[&str]) -> Output {
    let mut c = strata();
    c.args(args).args(["--threads", "2"]);
    c.output().expect("strata runs")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// `prompt P tokens = R reused + X read ...` from a summary line: (P, R, X).
fn summary(stderr: &str) -> Vec<(usize, usize, usize)> {
    stderr
        .lines()
        .filter_map(|l| {
            let rest = l.split("prompt ").nth(1)?;
            let nums: Vec<usize> = rest
                .split(|c: char| !c.is_ascii_digit())
                .filter(|s| !s.is_empty())
                .take(3)
                .map(|s| s.parse().unwrap())
                .collect();
            (rest.contains("reused") && nums.len() == 3).then(|| (nums[0], nums[1], nums[2]))
        })
        .collect()
}

#[test]
fn generate_chat_answers_paris_and_prints_the_summary_line() {
    let out = run(&[
        "generate",
        "--chat",
        "--system",
        "You are a helpful AI assistant.",
        "--prompt",
        "What is the capital of France?",
        "--max-tokens",
        "24",
    ]);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("Paris"), "stdout: {stdout}");
    let s = summary(&stderr);
    assert_eq!(s.len(), 1, "one summary line expected: {stderr}");
    let (p, r, x) = s[0];
    assert!(p > 10 && r == 0 && x == p, "{stderr}");
    assert!(stderr.contains("generated in") && stderr.contains("tok/s"), "{stderr}");
}

#[test]
fn the_same_seed_gives_the_same_text_and_stop_strings_cut_it() {
    let args = [
        "generate",
        "--prompt",
        "Once upon a time",
        "--max-tokens",
        "24",
        "--temp",
        "0.9",
        "--seed",
        "1234",
    ];
    let (a, b) = (run(&args), run(&args));
    assert!(a.status.success() && b.status.success());
    assert_eq!(text(&a.stdout), text(&b.stdout));
    // Greedy continuation, then the same with a stop string taken from inside it: the output ends before it.
    let greedy = text(&run(&["generate", "--prompt", "The capital of France is", "--max-tokens", "16"]).stdout);
    let stop = greedy.split_whitespace().nth(2).expect("a few words").to_string();
    let cut = run(&[
        "generate",
        "--prompt",
        "The capital of France is",
        "--max-tokens",
        "16",
        "--stop",
        &stop,
    ]);
    let cut = text(&cut.stdout);
    assert!(
        !cut.contains(&stop),
        "stop {stop:?} still in {cut:?} (greedy: {greedy:?})"
    );
    assert!(
        greedy.starts_with(cut.trim_end()),
        "{cut:?} is not a prefix of {greedy:?}"
    );
}

/// `--batch-invariant` on the CPU says its kernels are batch-invariant already and changes nothing.
#[test]
fn batch_invariant_on_the_cpu_says_so_and_changes_nothing() {
    let args = ["generate", "--prompt", "The capital of France is", "--max-tokens", "12"];
    let plain = run(&args);
    let inv = run(&[&args[..], &["--batch-invariant"]].concat());
    assert!(plain.status.success() && inv.status.success(), "{}", text(&inv.stderr));
    assert_eq!(text(&inv.stdout), text(&plain.stdout));
    let err = text(&inv.stderr);
    assert!(
        err.contains("--batch-invariant: cpu's kernels are batch-invariant already"),
        "{err}"
    );
    assert!(!text(&plain.stderr).contains("--batch-invariant"));
}

#[test]
fn a_prompt_over_the_context_fails_naming_both_counts() {
    let long = "word ".repeat(200);
    let out = run(&["generate", "--prompt", &long, "--max-context", "64"]);
    let stderr = text(&out.stderr);
    assert!(!out.status.success());
    // "the request needs N tokens of context but the context holds 64": both numbers, N over 64.
    let needs: usize = stderr
        .split("needs ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no count in {stderr}"));
    assert!(needs > 200 && stderr.contains("holds 64"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(out.stdout.is_empty(), "nothing generated: {}", text(&out.stdout));
}

#[test]
fn unknown_flags_and_values_are_clear_errors() {
    let out = run(&["generate", "--prompt", "hi", "--temperature", "1"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("--temperature"), "{}", text(&out.stderr));
    let out = run(&["generate", "--prompt", "hi", "--kv", "int4"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("int4"), "{}", text(&out.stderr));
    // A negative count is read as the flag's value, not as another flag.
    for bad in ["-1", "0", "257", "abc"] {
        let out = run(&["serve", "--parallel", bad]);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{bad}: {err}");
        assert!(
            err.contains("--parallel takes a sequence count from 1 to 256"),
            "{bad}: {err}"
        );
    }
}

/// On the CPU every slot's KV cache must fit in the host memory available (256 sequences of SmolLM2's 8,192-token
/// context need 45 GiB): a start that would be killed for memory once the caches fill is refused, naming the
/// numbers. On a host with that much memory free it starts.
#[test]
fn kv_caches_past_the_host_memory_are_refused_at_start() {
    let out = run(&[
        "generate",
        "--prompt",
        "hi",
        "--max-tokens",
        "1",
        "--parallel",
        "256",
        "--max-context",
        "8192",
    ]);
    let err = text(&out.stderr);
    let need = 256u64 * 8192 * 30 * 2 * 3 * 64 * 2;
    match strata_engine::experts::store::host_available_bytes() {
        Some(avail) if avail < need => {
            assert_eq!(out.status.code(), Some(1), "{err}");
            assert!(
                err.contains("the KV caches of 256 sequences of 8192 tokens") && err.contains("lower --parallel"),
                "{err}"
            );
        }
        _ => assert!(out.status.success(), "{err}"),
    }
}

/// `--kv-tokens` below one sequence's context is refused at start (a sequence could never reach its context), and
/// so is a pool past the host memory; a bad value is a usage error.
#[test]
fn a_kv_pool_smaller_than_a_context_or_past_the_memory_is_refused() {
    let out = run(&[
        "generate",
        "--prompt",
        "hi",
        "--max-context",
        "512",
        "--kv-tokens",
        "500",
    ]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("--kv-tokens 500 is less than one sequence's context (512 tokens"),
        "{err}"
    );
    for bad in ["0", "-3", "many"] {
        let out = run(&["generate", "--prompt", "hi", "--kv-tokens", bad]);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{bad}: {err}");
        assert!(err.contains("--kv-tokens takes a positive token count"), "{bad}: {err}");
    }
    let out = run(&["generate", "--prompt", "hi", "--kv-tokens", "99999999999999999999"]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--kv-tokens `99999999999999999999` is too large"), "{err}");
    // Past what the sequences can hold at once: lowered to that, with a line saying so.
    let huge = (1u64 << 40).to_string();
    let out = run(&["generate", "--prompt", "hi", "--max-tokens", "1", "--kv-tokens", &huge]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(
        err.contains(&format!(
            "--kv-tokens {huge} is more than the sequences can hold at once (--parallel 1 x --max-context 4096, each in whole blocks of 16): the pool holds 4096"
        )),
        "{err}"
    );
    // 256 sequences of 8192 tokens of SmolLM2 (23,040 bytes a token in f16) sharing 2,000,000 tokens: 42.9 GiB,
    // refused before anything is allocated where the host has less available (CI's machine has 24 GiB).
    let args = ["generate", "--prompt", "hi", "--max-tokens", "1", "--parallel", "256"];
    let out = run(&[&args[..], &["--max-context", "8192", "--kv-tokens", "2000000"]].concat());
    let err = text(&out.stderr);
    let available = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
        let line = m.lines().find(|l| l.starts_with("MemAvailable:"))?.to_string();
        line.split_whitespace().nth(1)?.parse::<u64>().ok()
    });
    if available.is_some_and(|kib| kib < 40 << 20) {
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(
            err.contains("the KV cache of 2000000 tokens (--kv-tokens, f16 KV) needs 42.92 GiB")
                && err.contains("lower --kv-tokens"),
            "{err}"
        );
    } else {
        eprintln!("MemAvailable {available:?} KiB: the 42.9 GiB pool may fit here, not checked");
    }
    // strata bench's sequences hold their whole tests: the flag would do nothing there, so it is refused.
    let out = run(&["bench", "--kv-tokens", "4096", "--llama-bench", "off"]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("does not apply here"), "{err}");
}

#[test]
fn chat_reuses_the_earlier_turns_from_the_kv_cache() {
    let mut child = strata()
        .args([
            "chat",
            "--threads",
            "2",
            "--max-tokens",
            "12",
            "--system",
            "You are a helpful AI assistant.",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"What is the capital of France?\nAnd of Italy?\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let s = summary(&stderr);
    assert_eq!(s.len(), 2, "two turns, two summary lines: {stderr}");
    // The second turn's prompt starts with the whole first exchange: most of it comes from the cache.
    let (p2, r2, x2) = s[1];
    assert!(r2 >= s[0].0 && r2 + x2 == p2, "{s:?}");
}

#[test]
fn a_chat_turn_over_the_context_is_dropped_and_the_chat_goes_on() {
    let mut child = strata()
        .args(["chat", "--threads", "2", "--max-tokens", "8", "--max-context", "128"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let long = "word ".repeat(200);
    child
        .stdin
        .take()
        .unwrap()
        .write_all(format!("{long}\nWhat is 2+2?\n").as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("holds 128") && stderr.contains("dropped"), "{stderr}");
    assert_eq!(summary(&stderr).len(), 1, "the second turn is answered: {stderr}");
}

/// `strata serve` on a CUDA device it cannot open (no driver here, or no 100th GPU on a GPU machine) exits at
/// once with one line naming the device, instead of listening with a worker that fails at every restart.
#[test]
fn serve_on_a_device_it_cannot_open_exits_with_one_line() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["serve", "--device", "cuda:99", "--port", "0"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("strata runs");
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        if start.elapsed().as_secs() > 30 {
            let _ = child.kill();
            panic!("strata serve --device cuda:99 still running after 30 s");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().expect("stderr"), &mut err).expect("stderr");
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(err.contains("cannot use --device cuda:99"), "{err}");
    assert!(!err.contains("listening"), "{err}");
}

/// The layer split's flag conflicts are refused before any device is opened (here, a machine without CUDA
/// would otherwise only say so), in `generate` and in `serve` (which would start a worker otherwise).
#[test]
fn a_layer_splits_flag_conflicts_are_named_before_the_device_opens() {
    for (extra, says) in [
        (
            &["--device", "cuda:0,cuda:1", "--batch-invariant"][..],
            "--batch-invariant is not available with a layer split",
        ),
        (
            &["--device", "cuda:0,cuda:1", "--expert-policy", "profile"][..],
            "--expert-policy profile is not available with a layer split",
        ),
        (
            &["--layer-split", "15,15"][..],
            "--layer-split 15,15 splits layers over several devices",
        ),
        (
            &["--device", "cuda:0", "--layer-split", "15,15"][..],
            "--layer-split 15,15 splits layers over several devices",
        ),
    ] {
        for cmd in [&["generate", "--prompt", "Hi"][..], &["serve", "--port", "0"][..]] {
            let out = run(&[cmd, extra].concat());
            let err = text(&out.stderr);
            assert!(!out.status.success() && err.contains(says), "{cmd:?} {extra:?}: {err}");
        }
    }
}
