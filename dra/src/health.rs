//! GPU health to kubelet: the reporter's view of its GPUs (XID events, NVML)
//! each round, streamed to kubelet's `NodeWatchResources` so that a pod whose
//! claim's GPU turns unhealthy says so in its status. Every round is sent again,
//! so kubelet's timeout only strikes when the reporter stops reporting.

use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::watch;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use crate::proto::health::{
    DeviceHealth, DeviceIdentifier, HealthStatus, NodeWatchResourcesRequest,
    NodeWatchResourcesResponse, health_server,
};

/// One device's health as the reporter saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuHealth {
    /// The device's name in the slice (`gpu-<minor>`).
    pub device: String,
    /// Whether it is healthy.
    pub healthy: bool,
}

/// A round: when, and each GPU's health (`None` before the first).
type Round = Option<(SystemTime, Vec<GpuHealth>)>;

/// Where the reporter posts each round's health; the service reads it.
#[derive(Debug, Clone)]
pub struct HealthFeed {
    sender: Arc<watch::Sender<Round>>,
}

impl Default for HealthFeed {
    fn default() -> Self {
        Self {
            sender: Arc::new(watch::Sender::new(None)),
        }
    }
}

impl HealthFeed {
    /// Posts this round's health (every round, changed or not).
    pub fn publish(&self, gpus: Vec<GpuHealth>) {
        self.sender.send_replace(Some((SystemTime::now(), gpus)));
    }

    fn subscribe(&self) -> watch::Receiver<Round> {
        self.sender.subscribe()
    }
}

/// kubelet's health service over a [`HealthFeed`].
#[derive(Debug, Clone)]
pub struct HealthService {
    node: String,
    feed: HealthFeed,
    /// Told to kubelet: how long without a round before it takes the health as
    /// unknown.
    timeout: Duration,
}

impl HealthService {
    /// Streams `feed`'s rounds for the devices of pool `node`; kubelet takes a
    /// device as unknown after `timeout` without one.
    pub fn new(node: String, feed: HealthFeed, timeout: Duration) -> Self {
        Self {
            node,
            feed,
            timeout,
        }
    }

    /// The tonic service.
    pub fn into_server(self) -> health_server::DRAResourceHealthServer<Self> {
        health_server::DRAResourceHealthServer::new(self)
    }

    fn response(&self, at: SystemTime, gpus: &[GpuHealth]) -> NodeWatchResourcesResponse {
        let seconds = at
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
        let timeout = i64::try_from(self.timeout.as_secs()).unwrap_or(i64::MAX);
        NodeWatchResourcesResponse {
            devices: gpus
                .iter()
                .map(|gpu| DeviceHealth {
                    device: Some(DeviceIdentifier {
                        pool_name: self.node.clone(),
                        device_name: gpu.device.clone(),
                    }),
                    health: if gpu.healthy {
                        HealthStatus::Healthy
                    } else {
                        HealthStatus::Unhealthy
                    } as i32,
                    last_updated_time: seconds,
                    health_check_timeout_seconds: timeout,
                })
                .collect(),
        }
    }
}

type Updates = Pin<Box<dyn Stream<Item = Result<NodeWatchResourcesResponse, Status>> + Send>>;

#[tonic::async_trait]
impl health_server::DRAResourceHealth for HealthService {
    type NodeWatchResourcesStream = Updates;

    async fn node_watch_resources(
        &self,
        _request: Request<NodeWatchResourcesRequest>,
    ) -> Result<Response<Self::NodeWatchResourcesStream>, Status> {
        let mut rounds = self.feed.subscribe();
        // The current round first, then each one after it.
        rounds.mark_changed();
        let service = self.clone();
        let updates = async_stream(move |tx| async move {
            while rounds.changed().await.is_ok() {
                let round = rounds.borrow_and_update().clone();
                if let Some((at, gpus)) = round {
                    if tx.send(Ok(service.response(at, &gpus))).await.is_err() {
                        return;
                    }
                }
            }
        });
        Ok(Response::new(updates))
    }
}

/// A stream fed by `produce` through a small channel (kubelet reads it).
fn async_stream<F, Fut>(produce: F) -> Updates
where
    F: FnOnce(tokio::sync::mpsc::Sender<Result<NodeWatchResourcesResponse, Status>>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tokio::spawn(produce(tx));
    Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::health::health_server::DRAResourceHealth;
    use tokio_stream::StreamExt;

    #[tokio::test]
    async fn streams_the_current_round_then_each_next_one() {
        let feed = HealthFeed::default();
        let service = HealthService::new("node-a".into(), feed.clone(), Duration::from_secs(90));
        feed.publish(vec![
            GpuHealth {
                device: "gpu-0".into(),
                healthy: true,
            },
            GpuHealth {
                device: "gpu-1".into(),
                healthy: false,
            },
        ]);
        let mut stream = service
            .node_watch_resources(Request::new(NodeWatchResourcesRequest {}))
            .await
            .expect("a stream")
            .into_inner();
        let first = stream.next().await.expect("a round").expect("ok");
        assert_eq!(first.devices.len(), 2);
        let device = first.devices[1].device.clone().expect("an identifier");
        assert_eq!(
            (device.pool_name.as_str(), device.device_name.as_str()),
            ("node-a", "gpu-1")
        );
        assert_eq!(first.devices[0].health, HealthStatus::Healthy as i32);
        assert_eq!(first.devices[1].health, HealthStatus::Unhealthy as i32);
        assert_eq!(first.devices[0].health_check_timeout_seconds, 90);
        assert!(first.devices[0].last_updated_time > 0);
        feed.publish(vec![GpuHealth {
            device: "gpu-0".into(),
            healthy: false,
        }]);
        let next = stream.next().await.expect("a round").expect("ok");
        assert_eq!(next.devices.len(), 1);
        assert_eq!(next.devices[0].health, HealthStatus::Unhealthy as i32);
    }
}
