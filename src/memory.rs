//! Memory the daemon gives back once it has started (DESIGN.md section 8,
//! "Memory per worker").
//!
//! Most of an idle worker's resident memory is not heap but pages of its
//! own executable: start-up (argument and config parsing, the connection,
//! stream and consumer set-up, the first reads of the KV buckets) runs
//! code that never runs again, and the kernel's fault-around maps 64 KiB
//! of page cache around every page touched. Once the worker pulls,
//! [`release_startup_pages`] drops the process's mappings of the clean,
//! read-only pages of its executable (`madvise(MADV_DONTNEED)`): what the
//! steady state runs is mapped again by its next (minor) page faults, the
//! rest stays out of the process. The pages stay in the page cache, shared
//! with other processes of the same binary, so nothing is read from disk
//! again (`MADV_PAGEOUT`, which evicts them, saved 0.5 MiB more but made
//! every later process of the binary read them back: the test suite, which
//! starts hundreds, read 2.7 GB more and ran a third longer). Mappings
//! with a written page (heap, relocated data) are never advised: for
//! those, the advice would throw the writes away.

use std::path::Path;

/// Drop this process's mappings of the clean, read-only pages of its
/// executable; the bytes advised (0 where `/proc` cannot be read). Best
/// effort, never fails.
pub(crate) fn release_startup_pages() -> usize {
    let (Ok(exe), Ok(smaps)) = (
        std::fs::read_link("/proc/self/exe"),
        std::fs::read_to_string("/proc/self/smaps"),
    ) else {
        return 0;
    };
    let mut advised = 0;
    for m in clean_read_only_mappings(&smaps, &exe) {
        // SAFETY: the range is a whole read-only private file mapping of
        // this process with no written (anonymous) page: after
        // MADV_DONTNEED the next access maps the file's page again, the
        // same bytes, so no memory the program relies on changes.
        let r = unsafe { libc::madvise(m.start as *mut libc::c_void, m.len, libc::MADV_DONTNEED) };
        if r == 0 {
            advised += m.len;
        }
    }
    advised
}

/// One mapping from `/proc/self/smaps`.
#[derive(Debug, PartialEq)]
struct Mapping {
    start: usize,
    len: usize,
}

/// The mappings of `exe` that are neither writable nor hold any anonymous
/// (copied-on-write) page: its code and read-only data, not its relocated
/// data.
fn clean_read_only_mappings(smaps: &str, exe: &Path) -> Vec<Mapping> {
    let exe = exe.to_string_lossy();
    let mut out = Vec::new();
    // (mapping, whether it qualifies so far)
    let mut cur: Option<(Mapping, bool)> = None;
    let mut flush = |cur: &mut Option<(Mapping, bool)>| {
        if let Some((m, true)) = cur.take() {
            out.push(m);
        }
    };
    for line in smaps.lines() {
        let mut f = line.split_whitespace();
        let first = f.next().unwrap_or("");
        if let Some((a, b)) = first.split_once('-') {
            if let (Ok(s), Ok(e)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)) {
                flush(&mut cur);
                let perms = f.next().unwrap_or("");
                // After offset, device and inode: the path, which may hold
                // spaces (and ends in " (deleted)" once the file is replaced,
                // as /proc/self/exe then does too).
                let path = f.skip(3).collect::<Vec<_>>().join(" ");
                let qualifies = path == exe && perms.as_bytes().get(1) == Some(&b'-');
                cur = Some((
                    Mapping {
                        start: s,
                        len: e - s,
                    },
                    qualifies,
                ));
                continue;
            }
        }
        if first == "Anonymous:" && f.next().is_some_and(|kb| kb != "0") {
            if let Some((_, q)) = cur.as_mut() {
                *q = false;
            }
        }
    }
    flush(&mut cur);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_clean_read_only_mappings_of_the_executable() {
        let smaps = "\
55e8e671000-55e8e907000 r--p 00000000 fe:00 53 /opt/jw/jetworker
Rss:                 700 kB
Anonymous:             0 kB
55e8e907000-55e8f2ff000 r-xp 00295000 fe:00 53 /opt/jw/jetworker
Rss:                4316 kB
Anonymous:             0 kB
55e8f2ff000-55e8f462000 r--p 00c8c000 fe:00 53 /opt/jw/jetworker
Rss:                1396 kB
Anonymous:          1396 kB
55e8f462000-55e8f469000 rw-p 00dee000 fe:00 53 /opt/jw/jetworker
Anonymous:            28 kB
7f0000000000-7f0000021000 r-xp 00000000 fe:00 99 /usr/lib/libc.so.6
Anonymous:             0 kB
7f0000100000-7f0000200000 rw-p 00000000 00:00 0
Anonymous:           512 kB
";
        let got = clean_read_only_mappings(smaps, Path::new("/opt/jw/jetworker"));
        assert_eq!(
            got,
            vec![
                Mapping {
                    start: 0x55e8e671000,
                    len: 0x55e8e907000 - 0x55e8e671000
                },
                Mapping {
                    start: 0x55e8e907000,
                    len: 0x55e8f2ff000 - 0x55e8e907000
                },
            ]
        );
    }

    #[test]
    fn a_path_with_spaces_or_replaced_on_disk() {
        let smaps = "\
1000-3000 r-xp 00000000 fe:00 53                    /opt/my jobs/jetworker (deleted)
Anonymous:             0 kB
3000-4000 r-xp 00000000 fe:00 53                    /opt/my jobs/jetworker
Anonymous:             0 kB
";
        let exe = Path::new("/opt/my jobs/jetworker (deleted)");
        assert_eq!(
            clean_read_only_mappings(smaps, exe),
            vec![Mapping {
                start: 0x1000,
                len: 0x2000
            }]
        );
    }

    #[test]
    fn the_test_binary_has_pages_to_hand_back() {
        // Its own code is a clean read-only mapping of its executable; the
        // kernel takes the advice, and code runs on after it.
        assert!(release_startup_pages() > 0);
        assert_eq!(format!("{}", 6 * 7), "42");
    }
}
