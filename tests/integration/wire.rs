//! Wire compatibility: task JSON checked in under `tests/fixtures/wire-v1`
//! (and the examples users copy) must keep parsing. A change that breaks
//! one of these breaks every publisher that sends it.

use jetworker::internals::ContainerSpec;
use jetworker::protocol::{parse_task, Envelope, Task, ValidationLimits};

fn parse_dir(dir: &str) -> Vec<(String, Task)> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(dir);
    let mut out = Vec::new();
    for e in std::fs::read_dir(&root).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "json") {
            let bytes = std::fs::read(&p).unwrap();
            let env = Envelope {
                label: "default",
                stream_sequence: 1,
                ..Default::default()
            };
            let t = parse_task(&bytes, &env, &ValidationLimits::default())
                .unwrap_or_else(|e| panic!("{} no longer parses: {e}", p.display()));
            out.push((p.file_name().unwrap().to_string_lossy().into_owned(), t));
        }
    }
    assert!(!out.is_empty(), "no fixtures in {dir}");
    out
}

#[test]
fn wire_v1_fixtures_still_parse() {
    let all = parse_dir("tests/fixtures/wire-v1");
    assert_eq!(all.len(), 6);
    for (name, task) in all {
        assert!(task.runnable(), "{name}: a built-in type");
        if name == "seed-container.json" {
            let c = task.spec::<ContainerSpec>().expect("a container task");
            assert_eq!(c.env.get("MODE").map(String::as_str), Some("batch"));
            assert_eq!(c.network.as_deref(), Some("none"));
        }
    }
}

#[test]
fn examples_parse() {
    parse_dir("examples/tasks");
}
