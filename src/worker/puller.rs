//! One label's pull requests, answered on one subscription that lives as
//! long as the puller.
//!
//! async-nats' `fetch()` subscribes to a new inbox for every pull and
//! unsubscribes when the batch ends. A busy worker pulls about once per
//! task (a slot frees, one message is asked for), so that is a `SUB` and an
//! `UNSUB` per task on the connection, and a subscription inserted into and
//! removed from the server's subject index. Here the inbox is subscribed
//! once; each pull is one request (`CONSUMER.MSG.NEXT`, the same request
//! with `no_wait` and `expires` that `fetch()` sends) and its batch is read from that
//! subscription with the same rules as async-nats' own batch: it ends after
//! as many messages as were asked for, on `404 No Messages` or `408 Request
//! Timeout`, on any other status (an error: the consumer is gone, the
//! leader moved), or 5 s after its expiry when the server never answered.
//!
//! Only one pull is outstanding at a time. A message of an earlier pull
//! that arrives late (its batch ended on the client's timer) is read as part
//! of the current one; the caller hands back whatever is more than it has
//! slots for, as before. A late status can only end the current batch
//! early, which costs one more pull.

use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull::BatchConfig, consumer::PullConsumer};
use async_nats::{StatusCode, Subject};
use futures::StreamExt;

/// How long after a pull's expiry the client stops waiting for the server.
const CLIENT_MARGIN: Duration = Duration::from_secs(5);

/// Pulls from one consumer over one subscription.
pub(crate) struct Puller {
    consumer: PullConsumer,
    /// The main connection's JetStream context: its connection carries the
    /// pulls and the inbox, and each message keeps it so that it can be
    /// answered (acked) there.
    context: jetstream::Context,
    /// The inbox and its subscription; `None` before the first pull and
    /// after the client ended it, so that the next pull subscribes (anew)
    /// rather than read an ended stream in a loop.
    sub: Option<(Subject, async_nats::Subscriber)>,
}

/// One item of a pull: a message, or the error that ended the batch.
pub(crate) type Item = Result<jetstream::Message, String>;

impl Puller {
    /// A puller for `consumer` on `context`'s connection; it subscribes
    /// its inbox at the first pull.
    pub(crate) fn new(context: jetstream::Context, consumer: PullConsumer) -> Self {
        Puller {
            consumer,
            context,
            sub: None,
        }
    }

    /// Use `consumer` from now on (it was recreated).
    pub(crate) fn set_consumer(&mut self, consumer: PullConsumer) {
        self.consumer = consumer;
    }

    /// Ask for up to `n` messages, waiting at the server up to `expires`
    /// for the first; `Err` when the inbox could not be subscribed or the
    /// request could not be sent.
    pub(crate) async fn pull(&mut self, n: usize, expires: Duration) -> Result<Batch<'_>, String> {
        let inbox = match &self.sub {
            Some((inbox, _)) => inbox.clone(),
            None => {
                let client = self.context.client();
                let inbox = Subject::from(client.new_inbox());
                let sub = client
                    .subscribe(inbox.clone())
                    .await
                    .map_err(|e| format!("cannot subscribe the pull inbox: {e}"))?;
                self.sub = Some((inbox.clone(), sub));
                inbox
            }
        };
        let request = BatchConfig {
            batch: n,
            expires: Some(expires),
            no_wait: true,
            ..Default::default()
        };
        self.consumer
            .request_batch(request, inbox)
            .await
            .map_err(|e| e.to_string())?;
        Ok(Batch {
            puller: self,
            left: n,
            deadline: tokio::time::Instant::now() + expires + CLIENT_MARGIN,
        })
    }
}

/// The answer to one pull, read from the puller's subscription.
pub(crate) struct Batch<'a> {
    puller: &'a mut Puller,
    /// Messages still to come before the batch is complete.
    left: usize,
    /// When the client stops waiting.
    deadline: tokio::time::Instant,
}

impl Batch<'_> {
    /// The next message; `None` once the batch has ended.
    pub(crate) async fn next(&mut self) -> Option<Item> {
        while self.left > 0 {
            // Subscribed by `pull`; taken only below, when it ended.
            let (_, sub) = self.puller.sub.as_mut()?;
            let msg = tokio::select! {
                biased;
                m = sub.next() => match m {
                    Some(m) => m,
                    None => {
                        self.puller.sub = None;
                        self.left = 0;
                        return Some(Err("the pull inbox's subscription ended".into()));
                    }
                },
                _ = tokio::time::sleep_until(self.deadline) => return None,
            };
            match msg.status.unwrap_or(StatusCode::OK) {
                StatusCode::OK => {
                    self.left -= 1;
                    return Some(Ok(jetstream::Message {
                        message: msg,
                        context: self.puller.context.clone(),
                    }));
                }
                StatusCode::IDLE_HEARTBEAT => continue,
                StatusCode::NOT_FOUND | StatusCode::TIMEOUT => break,
                status => {
                    self.left = 0;
                    return Some(Err(format!(
                        "error while pulling messages: {status}, {:?}",
                        msg.description
                    )));
                }
            }
        }
        self.left = 0;
        None
    }
}
