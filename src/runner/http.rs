//! The `http` runner (placeholder until issue 4 lands).

use super::{Outcome, RunContext};

pub struct HttpRunner;

impl HttpRunner {
    pub fn new(_deny_private: bool) -> anyhow::Result<Self> {
        Ok(HttpRunner)
    }
    pub async fn run(&self, _ctx: RunContext) -> Outcome {
        Outcome::failed("http tasks are not supported yet")
    }
}
