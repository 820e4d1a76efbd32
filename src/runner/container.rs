//! The `container` runner (placeholder until issue 4 lands).

use super::{Outcome, RunContext};

pub struct ContainerRunner;

impl ContainerRunner {
    pub fn new(
        _docker_host: Option<&str>,
        _default_network: Option<String>,
        _worker_id: &str,
    ) -> Self {
        ContainerRunner
    }
    pub async fn available(&self) -> bool {
        false
    }
    pub async fn run(&self, _ctx: RunContext) -> Outcome {
        Outcome::failed("container tasks are not supported yet")
    }
}
