//! Child processes that die with their parent: `strata serve`'s engine worker, and the harness's `strata serve`.
//! A parent killed by a signal (SIGINT, SIGTERM, SIGKILL) or an abort runs no cleanup, so without this its children
//! would run on with parent 1, holding a port, a GPU and gigabytes of memory (issue 19, point 12).

/// A `pre_exec` hook for the child: on Linux it asks the kernel to send the child SIGKILL when the parent thread
/// that spawned it ends (`prctl(PR_SET_PDEATHSIG)`), and kills the child at once if the parent already ended
/// between the fork and the hook (its parent id is no longer `parent`). Elsewhere it does nothing.
///
/// The signal follows the spawning *thread*: spawn from a thread that lives as long as the child should (the main
/// thread, or a runtime's worker thread; not a short-lived blocking-pool thread).
///
/// Errors (from the hook, failing the spawn): `prctl` refused.
pub fn die_with_parent() -> impl FnMut() -> std::io::Result<()> + Send + Sync + 'static {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: getpid has no preconditions.
        let parent = unsafe { libc::getpid() };
        move || {
            // SAFETY: prctl, getppid and raise are async-signal-safe, as a pre_exec hook requires.
            unsafe {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::getppid() != parent {
                    libc::raise(libc::SIGKILL);
                }
            }
            Ok(())
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        || Ok(())
    }
}
