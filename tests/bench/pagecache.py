"""The page-cache state a timed write starts from, made the same for every measurement (bench_http.py and
bench_round.py import it)."""
from pathlib import Path


def fresh_pages(directory, nbytes):
    """Frees nbytes of page cache just before a timed write, so the write's new page-cache pages are
    ones the kernel freed a moment ago.

    On a VM with free page reporting (virtio_balloon; the bench machine's dmesg says "Free page reporting
    enabled") the guest hands pages that stay free for ~2 s back to the host, and the first write into
    each one later faults in the host.  Measured there: dd of 1 GiB into the page cache took 2.1-2.5 s of
    system CPU when it grew the cache, 0.16 s right after a cached 1 GiB file was deleted (80% of it in
    copy_folio_from_iter_atomic, perf).  Which case a transfer or a pass got depended on whether the step
    before it happened to free pages (a replaced delta's unlink, a removed temporary directory): that,
    not the replacement, made replacing uploads look 3x slower, and most of the gap between the pass in
    the daemon (after 8 GiB of uploads grew the cache) and bench-outer (right after the previous sample's
    directory was removed).  Giving every timed write the same start measures the code instead of the
    hypervisor; on a machine without free page reporting it costs a write of nbytes and changes nothing."""
    path = Path(directory) / "fresh-pages"
    block = bytes(1 << 20)
    # no fsync: deleting a file drops its dirty pages without writing them, and the disk stays idle
    with open(path, "wb") as f:
        for _ in range((nbytes + (1 << 20) - 1) >> 20):
            f.write(block)
    path.unlink()


def memory_stall_s():
    """Seconds, since boot, during which some task waited for memory (reclaim, compaction, refaults):
    /proc/pressure/memory's "some" total.  The difference across a measurement says whether it paid for
    a full page cache; None without PSI."""
    try:
        with open("/proc/pressure/memory") as f:
            for line in f:
                if line.startswith("some "):
                    return int(line.rsplit("total=", 1)[1]) / 1e6
    except (OSError, ValueError, IndexError):
        pass
    return None


def stall_since(before):
    """Memory stall seconds since memory_stall_s() returned before (nan without PSI)."""
    now = memory_stall_s()
    return float("nan") if now is None or before is None else now - before
