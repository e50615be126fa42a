//! The extender HTTP API as kube-scheduler calls it (k8s.io/kube-scheduler/extender/v1,
//! PascalCase JSON): filter, prioritize, preempt, bind; plus health and readiness.
//! Filter and prioritize hold the GPUs of the node they expect kube-scheduler to
//! choose tentatively (docs/bind.md), so the next cycles see them taken.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client as HttpClient;
use hyper_util::client::legacy::connect::HttpConnector;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use k8s_openapi::api::core::v1::{Binding, Node, Pod};
use kube::api::{Patch, PatchParams, PostParams};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Client};
use serde::{Deserialize, Serialize};
use serde_json::json;
use tessera_api::request::{PodGpuRequest, RequestOptions, pod_gpu_request};
use tessera_api::resources::DEVICE_ALLOCATED;

use futures_util::FutureExt;
use futures_util::future::{BoxFuture, Shared};

use crate::bind::{
    Allocation, BindDecision, BindError, BindFailure, Target, binding, bound_allocation, decide,
    refused_for_good, took_effect,
};
use crate::events::BindObserver;
use crate::leader::Leader;
use tessera_allocator::allocate::{
    DryRun, PodPlacement, Policy, allocate_pod, gpu_victims, group_elsewhere, group_home,
    group_over_allowance, never_fits_pod, node_victims, score_pod_loaded, selected_nowhere,
    unfit_reason_pod,
};
use tessera_allocator::ledger::{Ledger, annotation_of, pod_name};

/// `ExtenderArgs`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct ExtenderArgs {
    /// The pod being scheduled.
    pub pod: Pod,
    /// Candidate nodes (when the extender is not nodeCacheCapable).
    #[serde(default)]
    pub nodes: Option<NodeList>,
    /// Candidate node names (nodeCacheCapable).
    #[serde(default)]
    pub node_names: Option<Vec<String>>,
}

/// A `v1.NodeList` as kube-scheduler sends it.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
pub struct NodeList {
    /// The nodes.
    #[serde(default)]
    pub items: Vec<Node>,
}

/// A node name as the HTTP path reads it: borrowed from the request body (no
/// allocation per name; a call carries thousands), owned where JSON escapes made
/// the text differ from the bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Name<'a>(Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for Name<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> serde::de::Visitor<'de> for Visitor<'a> {
            type Value = Name<'a>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: serde::de::Error>(
                self,
                v: &'de str,
            ) -> Result<Self::Value, E> {
                Ok(Name(Cow::Borrowed(v)))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Name(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E: serde::de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(Name(Cow::Owned(v)))
            }
        }
        deserializer.deserialize_str(Visitor(std::marker::PhantomData))
    }
}

/// [`ExtenderArgs`] as the HTTP path reads it, node names borrowed from the body
/// (named so in errors too, which go back to the caller).
#[derive(Deserialize)]
#[serde(expecting = "struct ExtenderArgs", rename_all = "PascalCase")]
struct ExtenderArgsIn<'a> {
    pod: Pod,
    #[serde(default)]
    nodes: Option<NodeList>,
    #[serde(default, borrow)]
    node_names: Option<Vec<Name<'a>>>,
}

/// The candidate names of a call: `NodeNames`, else the names of `Nodes`.
fn candidate_names<'a>(
    node_names: Option<Vec<Name<'a>>>,
    nodes: Option<&NodeList>,
) -> Vec<Name<'a>> {
    node_names.unwrap_or_else(|| {
        names_of(nodes)
            .into_iter()
            .map(|name| Name(Cow::Owned(name)))
            .collect()
    })
}

/// [`ExtenderFilterResult`] with the node names borrowed from the call's: written
/// out as the same JSON, field for field.
#[derive(Debug, Default, Serialize)]
#[serde(rename_all = "PascalCase")]
struct FilterAnswer<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    nodes: Option<serde_json::Value>,
    node_names: Option<Vec<&'a str>>,
    failed_nodes: BTreeMap<&'a str, String>,
    failed_and_unresolvable_nodes: BTreeMap<&'a str, String>,
    error: String,
}

impl FilterAnswer<'_> {
    /// See [`ExtenderFilterResult::for_kube_scheduler`].
    fn for_kube_scheduler(mut self) -> Self {
        without_percent_signs(
            self.failed_nodes
                .values_mut()
                .chain(self.failed_and_unresolvable_nodes.values_mut()),
        );
        self
    }

    fn into_owned(self) -> ExtenderFilterResult {
        let owned = |map: BTreeMap<&str, String>| {
            map.into_iter()
                .map(|(name, why)| (name.to_owned(), why))
                .collect()
        };
        ExtenderFilterResult {
            nodes: self.nodes,
            node_names: self
                .node_names
                .map(|names| names.into_iter().map(str::to_owned).collect()),
            failed_nodes: owned(self.failed_nodes),
            failed_and_unresolvable_nodes: owned(self.failed_and_unresolvable_nodes),
            error: self.error,
        }
    }
}

/// [`HostPriority`] with the host borrowed from the call's names.
#[derive(Debug, Serialize)]
#[serde(rename_all = "PascalCase")]
struct HostScore<'a> {
    host: &'a str,
    score: i64,
}

/// `ExtenderFilterResult`.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
#[serde(rename_all = "PascalCase")]
pub struct ExtenderFilterResult {
    /// Nodes that fit (not nodeCacheCapable).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nodes: Option<serde_json::Value>,
    /// Names of nodes that fit.
    #[serde(default)]
    pub node_names: Option<Vec<String>>,
    /// Node → why it does not fit now (preemption may help: kube-scheduler's
    /// dry run considers these nodes).
    #[serde(default)]
    pub failed_nodes: BTreeMap<String, String>,
    /// Node → why it can never fit (no Device CR, too few or too small GPUs, an
    /// invalid request, an unsynced cache): preemption skips these nodes.
    #[serde(default)]
    pub failed_and_unresolvable_nodes: BTreeMap<String, String>,
    /// An error that fails the whole call (never used: it makes the pod retry in
    /// a hot loop; every refusal names the node instead).
    #[serde(default)]
    pub error: String,
}

impl ExtenderFilterResult {
    /// The answer as kube-scheduler prints it: it hands each reason to its event
    /// recorder as a printf format, so `50%` would read `50%!c(MISSING)` in the pod's
    /// events; `50 percent` reads the same there and in the pod's condition.
    pub fn for_kube_scheduler(mut self) -> Self {
        without_percent_signs(
            self.failed_nodes
                .values_mut()
                .chain(self.failed_and_unresolvable_nodes.values_mut()),
        );
        self
    }
}

/// Spells out `%` in `reasons` (see [`ExtenderFilterResult::for_kube_scheduler`]).
fn without_percent_signs<'r>(reasons: impl Iterator<Item = &'r mut String>) {
    for reason in reasons {
        if reason.contains('%') {
            *reason = reason.replace('%', " percent");
        }
    }
}

/// `HostPriority`.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "PascalCase")]
pub struct HostPriority {
    /// Node name.
    pub host: String,
    /// 0..=10.
    pub score: i64,
}

/// `ExtenderPreemptionArgs`: the pod and, per candidate node, the victims
/// kube-scheduler's dry run chose (UIDs only when nodeCacheCapable, whole pods otherwise).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct ExtenderPreemptionArgs {
    /// The preemptor.
    pub pod: Pod,
    /// Node → victims as pods (not nodeCacheCapable).
    #[serde(default)]
    pub node_name_to_victims: Option<BTreeMap<String, Option<Victims>>>,
    /// Node → victims as UIDs (nodeCacheCapable).
    #[serde(default)]
    pub node_name_to_meta_victims: Option<BTreeMap<String, Option<MetaVictims>>>,
}

/// `Victims`.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct Victims {
    /// The pods to evict.
    #[serde(default)]
    pub pods: Option<Vec<Pod>>,
    /// PodDisruptionBudgets their eviction violates.
    #[serde(default, rename = "NumPDBViolations")]
    pub num_pdb_violations: i64,
}

/// `MetaVictims`.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "PascalCase")]
pub struct MetaVictims {
    /// The pods to evict, by UID.
    #[serde(default)]
    pub pods: Option<Vec<MetaPod>>,
    /// PodDisruptionBudgets their eviction violates (kube-scheduler's count for
    /// the dry run's set: Tessera cannot see the budgets and passes it on).
    #[serde(default, rename = "NumPDBViolations")]
    pub num_pdb_violations: i64,
}

/// `MetaPod`.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct MetaPod {
    /// The pod's UID.
    #[serde(rename = "UID")]
    pub uid: String,
}

/// `ExtenderPreemptionResult`: the nodes where preemption helps, each with the
/// victims it takes. A node left out is no candidate.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "PascalCase")]
pub struct ExtenderPreemptionResult {
    /// Node → victims.
    #[serde(default)]
    pub node_name_to_meta_victims: BTreeMap<String, MetaVictims>,
}

/// `ExtenderBindingArgs`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct ExtenderBindingArgs {
    /// Pod name.
    pub pod_name: String,
    /// Pod namespace.
    pub pod_namespace: String,
    /// Pod UID.
    #[serde(rename = "PodUID")]
    pub pod_uid: String,
    /// The chosen node.
    pub node: String,
}

/// The `keep` best-scored of the nodes that fit (`fit`, with their `scores`), in
/// their order: among equal scores the first ones, which kube-scheduler would
/// have preferred too. `keep` 0, or no more than `keep` nodes: all of them.
fn best_of(fit: Vec<&str>, scores: Vec<Option<i64>>, keep: usize) -> (Vec<&str>, Vec<Option<i64>>) {
    if keep == 0 || fit.len() <= keep {
        return (fit, scores);
    }
    // Best first, then earliest: the first `keep` of this order, put back in theirs.
    let mut order: Vec<usize> = (0..fit.len()).collect();
    let rank = |&i: &usize| (std::cmp::Reverse(scores.get(i).copied().flatten()), i);
    order.select_nth_unstable_by_key(keep - 1, rank);
    order.truncate(keep);
    order.sort_unstable();
    let kept = order.iter().filter_map(|&i| fit.get(i).copied()).collect();
    let kept_scores = order
        .iter()
        .map(|&i| scores.get(i).copied().flatten())
        .collect();
    (kept, kept_scores)
}

/// `ExtenderBindingResult`.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "PascalCase")]
pub struct ExtenderBindingResult {
    /// Empty on success.
    #[serde(default)]
    pub error: String,
}

/// Extender settings.
#[derive(Debug, Clone, Copy)]
pub struct ExtenderConfig {
    /// Which GPU on a node.
    pub gpu_policy: Policy,
    /// Which node (prioritize).
    pub node_policy: Policy,
    /// Request parsing.
    pub request: RequestOptions,
    /// How long an allocation stays reserved while in flight (reserve → bind not
    /// finished, or annotated and not bound). A bound pod's allocation never expires:
    /// it is held until the watch shows the pod bound, or its delete.
    pub reservation_ttl: Duration,
    /// The most GPUs the sharing groups of one namespace hold at once.
    pub group_gpus_per_namespace: u32,
    /// How many nodes filter answers for a GPU pod: the best-scored for its GPUs,
    /// in kube-scheduler's order among equals (0: every node that fits). With one,
    /// kube-scheduler takes it without scoring a node or calling prioritize.
    pub candidates: usize,
}

impl Default for ExtenderConfig {
    fn default() -> Self {
        Self {
            gpu_policy: Policy::Binpack,
            node_policy: Policy::Binpack,
            request: RequestOptions::default(),
            reservation_ttl: Duration::from_secs(30),
            group_gpus_per_namespace: tessera_allocator::allocate::GROUP_GPUS_PER_NAMESPACE,
            candidates: CANDIDATES,
        }
    }
}

/// How many nodes filter answers by default: one, the best for the pod's GPUs.
/// kube-scheduler then binds it without running its score plugins over every node
/// and without a prioritize call carrying every name, which at thousands of nodes
/// is most of what a GPU pod costs it (docs/benchmarks.md, issue 24).
pub const CANDIDATES: usize = 1;

/// The extender: the ledger, the way to the API server, and who leads.
#[derive(Clone)]
pub struct Extender {
    ledger: Arc<Mutex<Ledger>>,
    client: Option<Client>,
    pods: Option<Store<Pod>>,
    config: ExtenderConfig,
    ready: Arc<AtomicBool>,
    leader: Arc<Leader>,
    forwarder: Forwarder,
    started: Instant,
    /// Pod UID → the node and answer of its bind still running.
    binds: Arc<Mutex<HashMap<String, (String, RunningBind)>>>,
    /// Metrics and Events on pods ([`crate::events`]); never waits.
    observer: BindObserver,
    /// The scores the last filter computed, for the prioritize that follows it.
    scores: Arc<Mutex<Option<ScoreMemo>>>,
    /// How many prioritize answers took filter's scores (all or some).
    scores_reused: Arc<AtomicU64>,
}

/// The scores filter computed for the nodes it let through, kept for the
/// prioritize kube-scheduler calls next with those nodes (same pod, same list,
/// same order). Valid only while the ledger's nodes are as they were then
/// ([`Ledger::generation`]) and the pod asks the same: a score reads only its
/// node's state and the request. It saves prioritize a ledger lookup and a
/// reading of the node's load per name, thousands per call.
#[derive(Debug)]
struct ScoreMemo {
    uid: String,
    request: PodGpuRequest,
    generation: u64,
    /// The names filter let through, one after the other.
    names: String,
    /// Per name, in filter's order: where it ends in `names`, and its score.
    scores: Vec<(usize, Option<i64>)>,
}

impl ScoreMemo {
    /// The memo of `scores` of `names` for pod `uid`'s `request`, the ledger at `generation`.
    fn new(
        uid: &str,
        request: &PodGpuRequest,
        generation: u64,
        names: &[&str],
        scores: &[Option<i64>],
    ) -> Self {
        let mut all = String::with_capacity(names.iter().map(|n| n.len()).sum());
        let mut ends = Vec::with_capacity(names.len());
        for (name, score) in names.iter().zip(scores) {
            all.push_str(name);
            ends.push((all.len(), *score));
        }
        Self {
            uid: uid.to_owned(),
            request: request.clone(),
            generation,
            names: all,
            scores: ends,
        }
    }

    /// The score filter gave `name`, if it was the `index`-th name it let through
    /// (kube-scheduler passes them on in filter's order; any other is scored anew).
    fn score(&self, index: usize, name: &str) -> Option<Option<i64>> {
        let &(end, score) = self.scores.get(index)?;
        let start = index
            .checked_sub(1)
            .and_then(|before| self.scores.get(before))
            .map_or(0, |&(end, _)| end);
        (self.names.get(start..end) == Some(name)).then_some(score)
    }
}

/// How a follower reaches the leader to hand it a bind.
#[derive(Clone)]
enum Forwarder {
    /// Plain HTTP (the leader's URL is `http://`): a plain-HTTP extender.
    Plain(HttpClient<HttpConnector, Full<Bytes>>),
    /// HTTPS with this replica's certificate as client certificate, the leader's
    /// verified against the peer CA under a fixed name (it is dialled by pod IP).
    Tls(HttpClient<HttpsConnector<HttpConnector>, Full<Bytes>>),
}

impl Forwarder {
    async fn request(
        &self,
        request: Request<Full<Bytes>>,
    ) -> Result<Response<Incoming>, hyper_util::client::legacy::Error> {
        match self {
            Self::Plain(client) => client.request(request).await,
            Self::Tls(client) => client.request(request).await,
        }
    }
}

/// A bind running in its own task; every caller for its pod awaits the same answer.
type RunningBind = Shared<BoxFuture<'static, ExtenderBindingResult>>;

/// Removes a pod's running bind from the map when the bind's task ends.
struct BindDone(Arc<Mutex<HashMap<String, (String, RunningBind)>>>, String);

impl Drop for BindDone {
    fn drop(&mut self) {
        lock(&self.0).remove(&self.1);
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Why a node whose switch to the runtime proxy is unproven takes no GPU pod.
pub const SWITCH_UNPROVEN_WHY: &str = "the node's switch to tessera-runtime-proxy is not proven yet (taint tessera.io/runtime-proxy, or kubelet not connected to the proxy: Device CR tessera.io/switch-unproven, tessera-reporter's log says which): no GPU hook runs there to hold a grant; it takes GPU pods once tessera node switch-over (or the node installer) has proven it and kubelet calls through the proxy";
/// Why filter refuses every node while the cluster cache is not synced.
pub const NOT_SYNCED: &str = "tessera-scheduler's cluster cache is not synced (starting, relisting or reconnecting a watch): no node is judged from a partial view; retry";

/// Marks a bind a follower handed to the leader, so it is never handed on again.
pub const FORWARDED_HEADER: &str = "x-tessera-forwarded";

/// How long a follower waits for the leader to bind: well inside kube-scheduler's
/// extender `httpTimeout` (5 s in deploy/scheduler-config.yaml), so the follower
/// answers before kube-scheduler gives up and retries while the bind still runs.
pub const FORWARD_TIMEOUT: Duration = Duration::from_secs(4);

impl std::fmt::Debug for Extender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Extender")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Extender {
    /// An extender over `ledger`; `client` is needed to bind.
    pub fn new(
        ledger: Arc<Mutex<Ledger>>,
        client: Option<Client>,
        pods: Option<Store<Pod>>,
        config: ExtenderConfig,
        ready: Arc<AtomicBool>,
        leader: Arc<Leader>,
    ) -> Self {
        ledger
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .set_in_flight_ttl(config.reservation_ttl.as_secs());
        Self {
            ledger,
            client,
            pods,
            config,
            ready,
            leader,
            forwarder: Forwarder::Plain(
                HttpClient::builder(hyper_util::rt::TokioExecutor::new())
                    .build(HttpConnector::new()),
            ),
            started: Instant::now(),
            binds: Arc::default(),
            observer: BindObserver::default(),
            scores: Arc::default(),
            scores_reused: Arc::default(),
        }
    }

    /// Counts calls and binds into `observer`'s metrics and tells pods through its Events.
    pub fn with_observer(mut self, observer: BindObserver) -> Self {
        self.observer = observer;
        self
    }

    /// Hands binds to the leader over HTTPS: `tls` trusts the peer CA and presents
    /// this replica's certificate; the leader's certificate must name `server_name`.
    pub fn with_peer_tls(
        mut self,
        tls: rustls::ClientConfig,
        server_name: rustls::pki_types::ServerName<'static>,
    ) -> Self {
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            // Never plain: an http:// URL in the Lease must not carry kube-scheduler's
            // bind in the clear, nor be trusted to answer it.
            .https_only()
            .with_server_name_resolver(hyper_rustls::FixedServerNameResolver::new(server_name))
            .enable_http1()
            .build();
        self.forwarder = Forwarder::Tls(
            HttpClient::builder(hyper_util::rt::TokioExecutor::new()).build(connector),
        );
        self
    }

    fn ledger(&self) -> std::sync::MutexGuard<'_, Ledger> {
        self.ledger
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether every reflector has listed and is live (see [`crate::cluster`]).
    fn synced(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }

    fn now(&self) -> u64 {
        self.started.elapsed().as_secs()
    }

    /// Waits until no bind is running, at most `within`; returns how many still
    /// run. A stopping leader calls it before releasing the Lease.
    pub async fn drain(&self, within: Duration) -> usize {
        let deadline = Instant::now() + within;
        loop {
            let running = lock(&self.binds).len();
            if running == 0 || Instant::now() >= deadline {
                return running;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Gives back expired in-flight reservations; call periodically.
    pub fn expire_reservations(&self) -> usize {
        let now = self.now();
        self.ledger().expire(now)
    }

    /// Rewrites the pod-level allocation annotations of running pods into
    /// per-container grants ([`tessera_allocator::upgrade`]), on the leader only; returns how
    /// many were rewritten. Each patch is conditional on the pod's resource version:
    /// a pod changed meanwhile is taken up on the next round.
    pub async fn upgrade_pod_level_allocations(&self) -> usize {
        let (Some(client), Some(store)) = (&self.client, &self.pods) else {
            return 0;
        };
        if !self.leader.leading() || !self.ready.load(Ordering::SeqCst) {
            return 0;
        }
        let mut upgraded = 0;
        for pod in store.state() {
            // Fencing: stop writing the moment leadership ends, not at the next round.
            if !self.leader.leading() {
                break;
            }
            let Some(annotation) = tessera_allocator::upgrade::upgraded_annotation(&pod) else {
                continue;
            };
            let who = pod_name(&pod);
            let (Some(namespace), Some(name)) = (&pod.metadata.namespace, &pod.metadata.name)
            else {
                continue;
            };
            let patch = json!({"metadata": {
                "resourceVersion": pod.metadata.resource_version,
                "annotations": {DEVICE_ALLOCATED: annotation},
            }});
            let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
            match pods
                .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(_) => {
                    upgraded += 1;
                    tracing::info!(pod = %who, "allocation upgraded to per-container grants");
                }
                Err(error) => {
                    tracing::warn!(pod = %who, %error, "upgrading the allocation to per-container grants failed; retrying later");
                }
            }
        }
        upgraded
    }

    /// `filter`.
    pub fn filter(&self, args: ExtenderArgs) -> ExtenderFilterResult {
        let ExtenderArgs {
            pod,
            nodes,
            node_names,
        } = args;
        let node_names =
            node_names.map(|names| names.into_iter().map(|n| Name(Cow::Owned(n))).collect());
        let names = candidate_names(node_names, nodes.as_ref());
        self.filter_names(&pod, nodes, &names).into_owned()
    }

    /// `filter` over `names`, the answer borrowing them.
    fn filter_names<'n>(
        &self,
        pod: &Pod,
        nodes: Option<NodeList>,
        names: &'n [Name<'_>],
    ) -> FilterAnswer<'n> {
        let request = match pod_gpu_request(pod, &self.config.request) {
            Ok(Some(request)) => request,
            Ok(None) => {
                return FilterAnswer {
                    node_names: Some(names.iter().map(|name| name.0.as_ref()).collect()),
                    nodes: nodes.map(|n| json!(n)),
                    ..Default::default()
                };
            }
            Err(error) => {
                // Not `Error`: that fails the whole cycle and the pod retries in a
                // hot loop of backoffs. Unresolvable on every node, it waits for a
                // change, and preemption evicts nothing for it.
                let why = format!("pod {}: {error}", pod_name(pod));
                return refuse_all(names, nodes.is_some(), &why);
            }
        };
        if !self.synced() {
            // Not one node is judged from a partial view: each is refused, with why.
            return refuse_all(names, nodes.is_some(), NOT_SYNCED);
        }
        // A selection no GPU of the cluster passes (a model or UUID no node has) is
        // the pod's mistake, like an invalid request: the same on every node.
        let nowhere = selected_nowhere(self.ledger().nodes(), &request.selection);
        if let Some(why) = nowhere {
            let why = format!("pod {}: {why}", pod_name(pod));
            return refuse_all(names, nodes.is_some(), &why);
        }
        let mut result = FilterAnswer::default();
        let mut fit = Vec::with_capacity(names.len());
        // Scored here, where each fitting node is at hand, for the prioritize that follows.
        let mut scores = Vec::with_capacity(names.len());
        let uid = pod.metadata.uid.as_deref();
        let generation = {
            let mut ledger = self.ledger();
            // A new cycle of this pod: its earlier choice is not one any more, and
            // an earlier attempt's hold does not count against the pod itself.
            let aside = uid.and_then(|uid| {
                ledger.release_tentative(uid);
                ledger.set_aside(uid)
            });
            let home = group_home(ledger.nodes(), &request);
            let over = group_over_allowance(
                ledger.nodes(),
                &request,
                home.as_ref(),
                self.config.group_gpus_per_namespace,
            );
            // Every name looked up first, in a loop that does nothing else: each
            // lookup misses the cache, and with no judging in between the
            // processor waits for many misses at once, not one after another.
            let found: Vec<_> = names
                .iter()
                .map(|name| ledger.loaded_node(name.0.as_ref()))
                .collect();
            for (name, found) in names.iter().zip(found) {
                let name = name.0.as_ref();
                // A sharing group that holds a GPU on another node: unresolvable here,
                // as no eviction here moves the group.
                if let Some(why) = group_elsewhere(home.as_ref(), &request, name) {
                    result.failed_and_unresolvable_nodes.insert(name, why);
                    continue;
                }
                // A new group over its namespace's allowance: no node now, any once
                // one of the namespace's groups ends (and no eviction makes room).
                if let Some(why) = &over {
                    result
                        .failed_and_unresolvable_nodes
                        .insert(name, why.clone());
                    continue;
                }
                // No GPU hook runs there yet: whatever the pod tolerates, and however
                // empty its GPUs, nothing is placed until the switch is proven.
                if ledger.switch_unproven(name) {
                    result
                        .failed_and_unresolvable_nodes
                        .insert(name, SWITCH_UNPROVEN_WHY.into());
                    continue;
                }
                // Scored at once: a score is what a node that fits gets, and the
                // fit test alone would read the node's load a second time.
                let scored = found.map(|node| {
                    let score = score_pod_loaded(
                        node,
                        &request,
                        self.config.gpu_policy,
                        self.config.node_policy,
                    );
                    (node, score)
                });
                match scored {
                    None => {
                        result
                            .failed_and_unresolvable_nodes
                            .insert(name, "no Device CR: the node reports no GPUs".into());
                    }
                    Some((_, Some(score))) => {
                        fit.push(name);
                        scores.push(Some(score));
                    }
                    // Never fits, even emptied: kube-scheduler's preemption must not
                    // pick it (its own dry run ignores GPU shares and would see room).
                    Some((loaded, None)) => {
                        match never_fits_pod(loaded.state, &request, self.config.gpu_policy) {
                            Some(reason) => {
                                result.failed_and_unresolvable_nodes.insert(name, reason);
                            }
                            None => {
                                let reason = unfit_reason_pod(
                                    loaded.state,
                                    &request,
                                    self.config.gpu_policy,
                                );
                                result.failed_nodes.insert(name, reason);
                            }
                        }
                    }
                }
            }
            ledger.put_back(aside);
            ledger.generation()
        };
        let (fit, scores) = best_of(fit, scores, self.config.candidates);
        match (fit.as_slice(), uid) {
            ([only], Some(uid)) => {
                // One node fits: kube-scheduler takes it without calling prioritize.
                self.hold_tentatively(&mut self.ledger(), uid, only, &request);
            }
            ([_, _, ..], Some(uid)) => {
                let memo = ScoreMemo::new(uid, &request, generation, &fit, &scores);
                *lock(&self.scores) = Some(memo);
            }
            _ => {}
        }
        if let Some(list) = nodes {
            let keep: std::collections::HashSet<&str> = fit.iter().copied().collect();
            let items: Vec<Node> = list
                .items
                .into_iter()
                .filter(|n| n.metadata.name.as_deref().is_some_and(|m| keep.contains(m)))
                .collect();
            result.nodes = Some(json!({"items": items}));
        }
        result.node_names = Some(fit);
        result
    }

    /// `prioritize`. Holds the pod's GPUs tentatively on the node it scores best,
    /// the one kube-scheduler most likely chooses (its own scores are added to ours).
    pub fn prioritize(&self, args: ExtenderArgs) -> Vec<HostPriority> {
        let ExtenderArgs {
            pod,
            nodes,
            node_names,
        } = args;
        let node_names =
            node_names.map(|names| names.into_iter().map(|n| Name(Cow::Owned(n))).collect());
        let names = candidate_names(node_names, nodes.as_ref());
        self.prioritize_names(&pod, &names)
            .into_iter()
            .map(|scored| HostPriority {
                host: scored.host.to_owned(),
                score: scored.score,
            })
            .collect()
    }

    /// `prioritize` over `names`, the answer borrowing them.
    fn prioritize_names<'n>(&self, pod: &Pod, names: &'n [Name<'_>]) -> Vec<HostScore<'n>> {
        // Unsynced: no preference (filter has refused every node anyway).
        let request = pod_gpu_request(pod, &self.config.request)
            .ok()
            .flatten()
            .filter(|_| self.synced());
        let mut ledger = self.ledger();
        let uid = pod.metadata.uid.as_deref();
        // Filter's scores, if nothing they read changed since (taken either way:
        // they serve one prioritize). Checked before this call's own changes below,
        // which repeat filter's: the pod's tentative hold was given back there, and
        // its in-flight hold is set aside now as it was there.
        let memo = lock(&self.scores).take().filter(|memo| {
            Some(memo.uid.as_str()) == uid
                && memo.generation == ledger.generation()
                && request.as_ref() == Some(&memo.request)
        });
        let mut reused = false;
        // Scored without its own earlier choice, which would skew its node, and
        // without an earlier attempt's hold (see `Ledger::set_aside`).
        let aside = match (uid, &request) {
            (Some(uid), Some(_)) => {
                ledger.release_tentative(uid);
                ledger.set_aside(uid)
            }
            _ => None,
        };
        let mut best: Option<(i64, usize)> = None;
        let scores: Vec<HostScore<'n>> = names
            .iter()
            .enumerate()
            .map(|(index, host)| {
                let host = host.0.as_ref();
                // No GPU asked: no node looked up.
                let score = request.as_ref().and_then(|request| {
                    if let Some(score) = memo.as_ref().and_then(|memo| memo.score(index, host)) {
                        reused = true;
                        return score;
                    }
                    score_pod_loaded(
                        ledger.loaded_node(host)?,
                        request,
                        self.config.gpu_policy,
                        self.config.node_policy,
                    )
                });
                if let Some(score) = score
                    && best.is_none_or(|(top, _)| score > top)
                {
                    best = Some((score, index));
                }
                HostScore {
                    host,
                    score: score.unwrap_or(0),
                }
            })
            .collect();
        if reused {
            self.scores_reused.fetch_add(1, Ordering::Relaxed);
        }
        // Back before any new hold: a bind's hold is never replaced by a tentative one.
        ledger.put_back(aside);
        if let (Some(request), Some(uid), Some((_, index))) = (&request, uid, best) {
            self.hold_tentatively(&mut ledger, uid, scores[index].host, request);
        }
        scores
    }

    /// Holds the pod's GPUs on `node` tentatively, as its bind would place them
    /// (docs/bind.md): until its bind, its next cycle, or the reservation TTL.
    fn hold_tentatively(
        &self,
        ledger: &mut Ledger,
        uid: &str,
        node: &str,
        request: &PodGpuRequest,
    ) {
        let Some(state) = ledger.node(node) else {
            return;
        };
        if let Ok(placement) = allocate_pod(state, request, self.config.gpu_policy) {
            let expires = self.now() + self.config.reservation_ttl.as_secs();
            ledger.reserve_tentative(uid, node, placement.booked, expires);
        }
    }

    /// `preempt`: per candidate node, the victims whose GPU shares must go for the
    /// pod to get its GPUs there ([`gpu_victims`]), with the dry run's victims that
    /// hold no GPU; nodes where no eviction makes room are left out. kube-scheduler
    /// evicts what this answers, so every doubt leaves a node out: a pod asking no
    /// GPU keeps the dry run's answer, an invalid request or an unsynced cache
    /// leaves every node out.
    pub fn preempt(&self, args: ExtenderPreemptionArgs) -> ExtenderPreemptionResult {
        let ExtenderPreemptionArgs {
            pod,
            node_name_to_victims,
            node_name_to_meta_victims,
        } = args;
        let dry_run: BTreeMap<String, MetaVictims> = match node_name_to_meta_victims {
            Some(meta) => meta
                .into_iter()
                .map(|(node, victims)| (node, victims.unwrap_or_default()))
                .collect(),
            None => node_name_to_victims
                .unwrap_or_default()
                .into_iter()
                .map(|(node, victims)| {
                    let victims = victims.unwrap_or_default();
                    let pods = victims
                        .pods
                        .unwrap_or_default()
                        .into_iter()
                        .filter_map(|pod| pod.metadata.uid.map(|uid| MetaPod { uid }))
                        .collect();
                    let meta = MetaVictims {
                        pods: Some(pods),
                        num_pdb_violations: victims.num_pdb_violations,
                    };
                    (node, meta)
                })
                .collect(),
        };
        let who = pod_name(&pod);
        let request = match pod_gpu_request(&pod, &self.config.request) {
            Ok(Some(request)) => request,
            Ok(None) => {
                return ExtenderPreemptionResult {
                    node_name_to_meta_victims: dry_run,
                };
            }
            Err(error) => {
                tracing::info!(pod = %who, %error, "preempt: invalid request, no node");
                return ExtenderPreemptionResult::default();
            }
        };
        if !self.synced() {
            tracing::info!(pod = %who, "preempt: cache not synced, no node");
            return ExtenderPreemptionResult::default();
        }
        let priority = pod.spec.as_ref().and_then(|s| s.priority).unwrap_or(0);
        let ledger = self.ledger();
        let home = group_home(ledger.nodes(), &request);
        let mut result = ExtenderPreemptionResult::default();
        // Evicting pods of other namespaces frees no room in its namespace's allowance.
        if group_over_allowance(
            ledger.nodes(),
            &request,
            home.as_ref(),
            self.config.group_gpus_per_namespace,
        )
        .is_some()
        {
            return result;
        }
        for (name, victims) in dry_run {
            let Some(node) = ledger.node(&name) else {
                continue;
            };
            if group_elsewhere(home.as_ref(), &request, &name).is_some() {
                continue;
            }
            let holders = ledger.gpu_holders(&name);
            let gpu = match gpu_victims(node, &holders, &request, priority, self.config.gpu_policy)
            {
                Ok(gpu) => gpu,
                Err(why) => {
                    tracing::debug!(pod = %who, node = %name, %why, "preempt: node left out");
                    continue;
                }
            };
            let uids: Vec<String> = victims
                .pods
                .unwrap_or_default()
                .into_iter()
                .map(|pod| pod.uid)
                .collect();
            let holds_gpus = |uid: &str| {
                holders.iter().any(|h| h.uid == uid) || ledger.holds_legacy_gpus(&name, uid)
            };
            let priority_of = |uid: &str| {
                holders
                    .iter()
                    .find(|h| h.uid == uid)
                    .map(|h| h.priority)
                    .or_else(|| ledger.priority(uid))
            };
            let dry = DryRun {
                victims: &uids,
                holds_gpus: &holds_gpus,
                priority: &priority_of,
            };
            let Some(chosen) = node_victims(dry, gpu) else {
                tracing::debug!(pod = %who, node = %name, "preempt: nothing to evict for GPUs or otherwise; node left out");
                continue;
            };
            tracing::info!(pod = %who, node = %name, victims = ?chosen, "preempt: victims chosen per GPU");
            result.node_name_to_meta_victims.insert(
                name,
                MetaVictims {
                    pods: Some(chosen.into_iter().map(|uid| MetaPod { uid }).collect()),
                    num_pdb_violations: victims.num_pdb_violations,
                },
            );
        }
        result
    }

    /// `bind`, one at a time per pod UID: a bind for a UID whose bind is still
    /// running (kube-scheduler retried after its `httpTimeout`) joins it and gets its
    /// answer, never running reserve/rollback of its own; one for another node waits
    /// for it and is then decided from the pod's state. The work runs in its own task,
    /// so a caller that gives up does not cut a bind in half.
    /// A follower hands the bind to the leader (unless it was handed over already).
    pub async fn bind(&self, args: &ExtenderBindingArgs, forwarded: bool) -> ExtenderBindingResult {
        let answer = |outcome: Result<(), BindFailure>| ExtenderBindingResult {
            error: outcome.err().map(|e| e.to_string()).unwrap_or_default(),
        };
        let who = format!("{}/{}", args.pod_namespace, args.pod_name);
        if !self.leader.leading() {
            return match (forwarded, self.leader.url()) {
                (false, Some(url)) => {
                    let result = self.forward_bind(&url, args).await;
                    self.observer.forwarded(&result);
                    result
                }
                _ => {
                    self.observer.refused(args, &BindError::NotLeader);
                    answer(Err(BindFailure {
                        pod: who,
                        error: BindError::NotLeader,
                    }))
                }
            };
        }
        if !self.synced() {
            self.observer.refused(args, &BindError::NotSynced);
            return answer(Err(BindFailure {
                pod: who,
                error: BindError::NotSynced,
            }));
        }
        loop {
            let (running, joined) = {
                let mut binds = lock(&self.binds);
                match binds.get(&args.pod_uid) {
                    // Another bind of this pod runs: join it (same node) or wait for it.
                    Some((node, running)) => (running.clone(), node == &args.node),
                    None => {
                        let this = self.clone();
                        let owned = args.clone();
                        let task = tokio::spawn(async move {
                            // Ends the pod's entry however the bind ends (a panic included).
                            let _done = BindDone(Arc::clone(&this.binds), owned.pod_uid.clone());
                            let outcome = this.bind_once(&owned).await;
                            this.observer.finished(&owned, &outcome);
                            answer(outcome)
                        });
                        let who = who.clone();
                        let running = async move {
                            task.await.unwrap_or_else(|e| ExtenderBindingResult {
                                error: format!("pod {who}: bind task failed: {e}"),
                            })
                        }
                        .boxed()
                        .shared();
                        binds.insert(args.pod_uid.clone(), (args.node.clone(), running.clone()));
                        // Ours: its answer is ours, whatever happened meanwhile.
                        (running, true)
                    }
                }
            };
            let result = running.await;
            if joined {
                return result;
            }
        }
    }

    /// One bind, start to end: read → decide → reserve → bind (one write that
    /// carries the allocation) → confirm, when the Binding's answer failed.
    async fn bind_once(&self, args: &ExtenderBindingArgs) -> Result<(), BindFailure> {
        let fail = |error: BindError| BindFailure {
            pod: format!("{}/{}", args.pod_namespace, args.pod_name),
            error,
        };
        let client = self
            .client
            .clone()
            .ok_or_else(|| fail(BindError::NoClient))?;
        let pods: Api<Pod> = Api::namespaced(client, &args.pod_namespace);
        // After a bind of this pod (its answer lost, or kube-scheduler retrying on a
        // lagging cache), the cache may still show it unbound: read it from the API
        // server, lest a Binding refused as stale give back the GPUs it holds.
        let held = self.ledger().holds_bind(&args.pod_uid);
        let cached = self.pods.as_ref().filter(|_| !held).and_then(|store| {
            store.get(&ObjectRef::new(&args.pod_name).within(&args.pod_namespace))
        });
        let mut pod = match cached {
            Some(pod) if pod.metadata.uid.as_deref() == Some(args.pod_uid.as_str()) => {
                Pod::clone(&pod)
            }
            _ => pods
                .get(&args.pod_name)
                .await
                .map_err(|e| fail(BindError::Read(e)))?,
        };
        let target = Target {
            namespace: &args.pod_namespace,
            name: &args.pod_name,
            uid: &args.pod_uid,
            node: &args.node,
        };
        // The cache may lag: a Binding refused as a conflict (the pod was bound
        // meanwhile) decides once more from the pod as read again.
        let mut fresh = false;
        loop {
            // From the pod as read (again, after a conflict): what it asks now.
            let request = pod_gpu_request(&pod, &self.config.request)
                .map_err(|e| fail(BindError::Request(e)))?;
            // Bound already (by an earlier bind whose answer was lost, or another
            // replica): what it holds is held as assumed until the watch shows it.
            self.hold_as_bound(&args.pod_uid, &pod);
            let decision =
                decide(&pod, &args.pod_uid, &args.node, request.is_some()).map_err(&fail)?;
            if decision == BindDecision::AlreadyBound {
                tracing::info!(pod = %format!("{}/{}", args.pod_namespace, args.pod_name), node = %args.node, "already bound: answered from its state");
                return Ok(());
            }
            let Some(request) = &request else {
                let plain = binding(&pod, target, None);
                return match self.create_binding(&pods, args, &plain, None).await {
                    Ok(()) => Ok(()),
                    Err((error, _)) => Err(fail(error)),
                };
            };
            // Fencing: a replica whose renew deadline passed (or that is stopping)
            // writes no allocation; one written already is seen by the next leader.
            if !self.leader.leading() {
                return Err(fail(BindError::LeadershipLost));
            }
            let written = self.reserve(args, request).map_err(&fail)?;
            let allocation = Allocation {
                written: &written,
                requested_as: request.requested_as(),
            };
            let placing = binding(&pod, target, Some(&allocation));
            match self
                .create_binding(&pods, args, &placing, Some(&written))
                .await
            {
                Ok(()) => return Ok(()),
                Err((BindError::Bind { source, .. }, Some(again)))
                    if !fresh && matches!(&source, kube::Error::Api(s) if s.code == 409) =>
                {
                    fresh = true;
                    pod = again;
                }
                Err((error, _)) => return Err(fail(error)),
            }
        }
    }

    /// Reserve: chooses GPUs and holds them under the ledger's lock, so parallel
    /// binds to one node see each other; returns the annotation to write.
    fn reserve(
        &self,
        args: &ExtenderBindingArgs,
        request: &PodGpuRequest,
    ) -> Result<String, BindError> {
        let mut ledger = self.ledger();
        // The pod's own tentative choice must not crowd out its bind, nor an
        // earlier attempt's in-flight hold (a bind whose outcome was lost, or its
        // annotation seen unbound after a relist): as in filter, counted against
        // the pod it would refuse the pod its own GPUs until the hold expired. The
        // per-UID join means no other bind of this pod runs now; the new
        // reservation replaces the hold, and the pod's annotation is replaced with
        // the resourceVersion read as precondition. A refusal restores the hold.
        ledger.release_tentative(&args.pod_uid);
        let aside = ledger.set_aside(&args.pod_uid);
        let placement = match self.choose_for_bind(&ledger, args, request) {
            Ok(placement) => placement,
            Err(error) => {
                ledger.put_back(aside);
                return Err(error);
            }
        };
        let expires = self.now() + self.config.reservation_ttl.as_secs();
        // Replaces the set-aside hold for good.
        drop(aside);
        ledger.reserve(&args.pod_uid, &args.node, placement.booked.clone(), expires);
        Ok(annotation_of(&placement))
    }

    /// The GPUs of `args.node` the pod's bind takes, judged under the ledger's
    /// lock: two binds of one new sharing group never take GPUs on two nodes.
    fn choose_for_bind(
        &self,
        ledger: &Ledger,
        args: &ExtenderBindingArgs,
        request: &PodGpuRequest,
    ) -> Result<PodPlacement, BindError> {
        let home = group_home(ledger.nodes(), request);
        // Under the ledger's lock: two new groups of one namespace never both take
        // the namespace's last GPU.
        let over = group_over_allowance(
            ledger.nodes(),
            request,
            home.as_ref(),
            self.config.group_gpus_per_namespace,
        );
        if let Some(reason) = group_elsewhere(home.as_ref(), request, &args.node).or(over) {
            return Err(BindError::Unfit {
                node: args.node.clone(),
                reason,
            });
        }
        let node = ledger.node(&args.node).ok_or_else(|| BindError::NoDevice {
            node: args.node.clone(),
        })?;
        allocate_pod(node, request, self.config.gpu_policy).map_err(|reason| BindError::Unfit {
            node: args.node.clone(),
            reason,
        })
    }

    /// Holds what pod `uid` holds, as read, when it is bound with an allocation
    /// ([`Ledger::hold_bound`]; nothing when the watch has shown it already).
    fn hold_as_bound(&self, uid: &str, pod: &Pod) {
        if let Some((node, allocations)) = bound_allocation(pod) {
            self.ledger().hold_bound(uid, node, &allocations);
        }
    }

    /// Creates `binding` (carrying `written`, the allocation, if any). Bound: the
    /// reservation becomes an assumed use. Refused: the pod is read again, since
    /// the Binding may have taken effect although its answer was lost; if it did
    /// not, nothing of it stands (a Binding writes all or nothing), the
    /// reservation is given back and the error comes with the pod as read again.
    /// If it cannot be read, the reservation stays in flight until the watch or
    /// its TTL settles it.
    async fn create_binding(
        &self,
        pods: &Api<Pod>,
        args: &ExtenderBindingArgs,
        binding: &Binding,
        written: Option<&str>,
    ) -> Result<(), (BindError, Option<Pod>)> {
        let who = || format!("{}/{}", args.pod_namespace, args.pod_name);
        let created = pods
            .create_subresource::<Binding, serde_json::Value>(
                "binding",
                &args.pod_name,
                &PostParams::default(),
                binding,
            )
            .await;
        let error = match created {
            Ok(_) => {
                // Bound: the reservation is an assumed use until the watch shows the pod.
                self.ledger().assume(&args.pod_uid);
                tracing::info!(pod = %who(), node = %args.node, gpus = written.is_some(), "bound");
                self.observer.placed(args, written);
                return Ok(());
            }
            Err(error) => error,
        };
        let node = args.node.clone();
        let again = match pods.get(&args.pod_name).await {
            Ok(pod) => pod,
            Err(source) => {
                let error = BindError::BindUnconfirmed {
                    node,
                    bind: Box::new(error),
                    source,
                };
                return Err((error, None));
            }
        };
        if took_effect(&again, &args.pod_uid, &args.node, written) {
            self.ledger().assume(&args.pod_uid);
            tracing::info!(pod = %who(), node = %args.node, %error, "the Binding's answer failed but the pod is bound");
            self.observer.placed(args, written);
            return Ok(());
        }
        if written.is_some() && !refused_for_good(&error) && bound_allocation(&again).is_none() {
            // Not refused, not applied yet: the API server may still apply it (a slow
            // webhook, a slow etcd), and given back now its GPUs could be handed out
            // again before the watch shows the pod holding them.
            let error = BindError::BindPending { node, bind: error };
            return Err((error, None));
        }
        {
            let mut ledger = self.ledger();
            ledger.release(&args.pod_uid);
            if let Some((bound, allocations)) = bound_allocation(&again) {
                ledger.hold_bound(&args.pod_uid, bound, &allocations);
            }
        }
        Err((
            BindError::Bind {
                node,
                source: error,
            },
            Some(again),
        ))
    }

    /// Sends the bind to the leader at `url` and returns its answer.
    async fn forward_bind(&self, url: &str, args: &ExtenderBindingArgs) -> ExtenderBindingResult {
        let failed = |problem: String| ExtenderBindingResult {
            error: BindFailure {
                pod: format!("{}/{}", args.pod_namespace, args.pod_name),
                error: BindError::Forward {
                    url: url.to_owned(),
                    problem,
                },
            }
            .to_string(),
        };
        let body = match serde_json::to_vec(args) {
            Ok(body) => body,
            Err(e) => return failed(e.to_string()),
        };
        let request = Request::post(format!("{}/bind", url.trim_end_matches('/')))
            .header(http::header::CONTENT_TYPE, "application/json")
            .header(FORWARDED_HEADER, "1")
            .body(Full::new(Bytes::from(body)));
        let request = match request {
            Ok(request) => request,
            Err(e) => return failed(e.to_string()),
        };
        let call = async {
            let response = self
                .forwarder
                .request(request)
                .await
                .map_err(|e| e.to_string())?;
            let status = response.status();
            let bytes = response
                .into_body()
                .collect()
                .await
                .map_err(|e| e.to_string())?
                .to_bytes();
            if !status.is_success() {
                return Err(format!("{status}: {}", String::from_utf8_lossy(&bytes)));
            }
            serde_json::from_slice::<ExtenderBindingResult>(&bytes).map_err(|e| e.to_string())
        };
        match tokio::time::timeout(FORWARD_TIMEOUT, call).await {
            Ok(Ok(result)) => {
                tracing::debug!(pod = %format!("{}/{}", args.pod_namespace, args.pod_name), leader = url, "bind handed to the leader");
                result
            }
            Ok(Err(problem)) => failed(problem),
            Err(_) => failed(format!("no answer in {FORWARD_TIMEOUT:?}")),
        }
    }

    /// `filter` from and to the wire: the node names are read in place from `body`
    /// and written from there (see [`Name`], [`wire`]). The outer error is the request's.
    fn filter_json(&self, body: &[u8]) -> serde_json::Result<serde_json::Result<Vec<u8>>> {
        let args = wire::read_args(body)?;
        let names = candidate_names(args.node_names, args.nodes.as_ref());
        let answer = self.filter_names(&args.pod, args.nodes, &names);
        Ok(encode_filter(&answer.for_kube_scheduler()))
    }

    /// `prioritize` from and to the wire, as [`Extender::filter_json`].
    fn prioritize_json(&self, body: &[u8]) -> serde_json::Result<serde_json::Result<Vec<u8>>> {
        let args = wire::read_args(body)?;
        let names = candidate_names(args.node_names, args.nodes.as_ref());
        Ok(encode_scores(&self.prioritize_names(&args.pod, &names)))
    }

    /// Serves one HTTP request.
    pub async fn handle(&self, request: Request<Incoming>) -> Response<Full<Bytes>> {
        let (method, path) = (request.method().clone(), request.uri().path().to_owned());
        let span = tracing::debug_span!("extender", %method, %path);
        let _entered = span.enter();
        let respond = |status: StatusCode, body: Vec<u8>| {
            let mut response = Response::new(Full::new(Bytes::from(body)));
            *response.status_mut() = status;
            response.headers_mut().insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("application/json"),
            );
            response
        };
        match (&method, path.trim_end_matches('/')) {
            (&Method::GET, "/healthz") => return respond(StatusCode::OK, b"ok".to_vec()),
            (&Method::GET, "/readyz") => {
                return if self.ready.load(Ordering::SeqCst) {
                    respond(StatusCode::OK, b"ok".to_vec())
                } else {
                    respond(
                        StatusCode::SERVICE_UNAVAILABLE,
                        b"cache not synced".to_vec(),
                    )
                };
            }
            (&Method::POST, _) => {}
            _ => return respond(StatusCode::NOT_FOUND, b"not found".to_vec()),
        }
        drop(_entered);
        let forwarded = request.headers().contains_key(FORWARDED_HEADER);
        let body = match http_body_util::Limited::new(request.into_body(), MAX_BODY_BYTES)
            .collect()
            .await
        {
            Ok(body) => body.to_bytes(),
            Err(e) if e.is::<http_body_util::LengthLimitError>() => {
                return respond(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    format!("{path}: request body over {MAX_BODY_BYTES} bytes").into_bytes(),
                );
            }
            Err(e) => {
                return respond(
                    StatusCode::BAD_REQUEST,
                    format!("reading body: {e}").into_bytes(),
                );
            }
        };
        let bad = |e: serde_json::Error| {
            respond(
                StatusCode::BAD_REQUEST,
                format!("{path}: invalid JSON: {e}").into_bytes(),
            )
        };
        let started = Instant::now();
        let encoded = match verb(&path) {
            "filter" => self.filter_json(&body),
            "prioritize" => self.prioritize_json(&body),
            "preempt" => serde_json::from_slice::<ExtenderPreemptionArgs>(&body)
                .map(|args| serde_json::to_vec(&self.preempt(args))),
            "bind" => match serde_json::from_slice::<ExtenderBindingArgs>(&body) {
                Ok(args) => Ok(serde_json::to_vec(&self.bind(&args, forwarded).await)),
                Err(e) => Err(e),
            },
            _ => return respond(StatusCode::NOT_FOUND, b"not found".to_vec()),
        };
        self.observer.request(verb(&path), started.elapsed());
        match encoded {
            Ok(Ok(bytes)) => respond(StatusCode::OK, bytes),
            Ok(Err(e)) | Err(e) => bad(e),
        }
    }
}

/// Writes `name` as a JSON string, as serde_json would: copied as it is when
/// nothing in it needs escaping (node names never do), else escaped by serde_json.
/// A call writes thousands of names; serde_json's string writer costs several
/// times a copy of one.
fn write_name(out: &mut Vec<u8>, name: &str) -> serde_json::Result<()> {
    if wire::plain_prefix(name.as_bytes()) == name.len() {
        out.reserve(name.len() + 2);
        out.push(b'"');
        out.extend_from_slice(name.as_bytes());
        out.push(b'"');
        Ok(())
    } else {
        serde_json::to_writer(out, name)
    }
}

/// Writes `score` as serde_json would (prioritize's scores are 0..=10).
fn write_score(out: &mut Vec<u8>, score: i64) -> serde_json::Result<()> {
    match u8::try_from(score) {
        Ok(digit @ 0..=9) => {
            out.push(b'0' + digit);
            Ok(())
        }
        _ => serde_json::to_writer(out, &score),
    }
}

/// Prioritize's answer as JSON: the bytes `serde_json::to_vec(scores)` writes
/// (a test holds them equal), written without serde's per-field machinery.
fn encode_scores(scores: &[HostScore<'_>]) -> serde_json::Result<Vec<u8>> {
    const ENTRY: usize = r#"{"Host":"","Score":10},"#.len();
    let bytes = scores.iter().map(|s| s.host.len() + ENTRY).sum::<usize>() + 2;
    let mut out = Vec::with_capacity(bytes);
    out.push(b'[');
    for (index, scored) in scores.iter().enumerate() {
        if index > 0 {
            out.push(b',');
        }
        out.extend_from_slice(br#"{"Host":"#);
        write_name(&mut out, scored.host)?;
        out.extend_from_slice(br#","Score":"#);
        write_score(&mut out, scored.score)?;
        out.push(b'}');
    }
    out.push(b']');
    Ok(out)
}

/// Filter's answer as JSON: the bytes `serde_json::to_vec(answer)` writes (a test
/// holds them equal), the node names copied as they are ([`write_name`]).
fn encode_filter(answer: &FilterAnswer<'_>) -> serde_json::Result<Vec<u8>> {
    let names = answer.node_names.as_deref().unwrap_or_default();
    let bytes = names.iter().map(|name| name.len() + 3).sum::<usize>() + 128;
    let mut out = Vec::with_capacity(bytes);
    out.push(b'{');
    if let Some(nodes) = &answer.nodes {
        out.extend_from_slice(br#""Nodes":"#);
        serde_json::to_writer(&mut out, nodes)?;
        out.push(b',');
    }
    out.extend_from_slice(br#""NodeNames":"#);
    match &answer.node_names {
        Some(names) => {
            out.push(b'[');
            for (index, name) in names.iter().enumerate() {
                if index > 0 {
                    out.push(b',');
                }
                write_name(&mut out, name)?;
            }
            out.push(b']');
        }
        None => out.extend_from_slice(b"null"),
    }
    for (field, reasons) in [
        (&br#","FailedNodes":"#[..], &answer.failed_nodes),
        (
            &br#","FailedAndUnresolvableNodes":"#[..],
            &answer.failed_and_unresolvable_nodes,
        ),
    ] {
        out.extend_from_slice(field);
        out.push(b'{');
        for (index, (name, why)) in reasons.iter().enumerate() {
            if index > 0 {
                out.push(b',');
            }
            write_name(&mut out, name)?;
            out.push(b':');
            serde_json::to_writer(&mut out, why)?;
        }
        out.push(b'}');
    }
    out.extend_from_slice(br#","Error":"#);
    serde_json::to_writer(&mut out, &answer.error)?;
    out.push(b'}');
    Ok(out)
}

/// The verb a request path names: its last segment (kube-scheduler sends
/// `<urlPrefix>/<verb>`). Access checks ([`crate::transport::BindAccess`]) and routing
/// both use it, so they never disagree about which verb a path calls.
pub fn verb(path: &str) -> &str {
    path.trim_end_matches('/').rsplit('/').next().unwrap_or("")
}

/// Every node unresolvable for `why`; no node fits (an empty list, also of
/// nodes when kube-scheduler sent nodes rather than names).
fn refuse_all<'n>(names: &'n [Name<'_>], sent_nodes: bool, why: &str) -> FilterAnswer<'n> {
    FilterAnswer {
        failed_and_unresolvable_nodes: names
            .iter()
            .map(|name| (name.0.as_ref(), why.to_owned()))
            .collect(),
        node_names: Some(Vec::new()),
        nodes: sent_nodes.then(|| json!({"items": []})),
        ..FilterAnswer::default()
    }
}

fn names_of(nodes: Option<&NodeList>) -> Vec<String> {
    nodes
        .map(|list| {
            list.items
                .iter()
                .filter_map(|n| n.metadata.name.clone())
                .collect()
        })
        .unwrap_or_default()
}

/// The largest request body read: kube-scheduler's filter, prioritize and preempt
/// calls with node names (`nodeCacheCapable`) stay far below it even at 5,000 nodes;
/// a larger body is refused before it is held.
pub const MAX_BODY_BYTES: usize = 16 << 20;

/// Serves the extender on `listener` until the task is dropped.
pub async fn serve(listener: tokio::net::TcpListener, extender: Extender) {
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(error) => {
                tracing::warn!(%error, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let extender = extender.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request| {
                let extender = extender.clone();
                async move { Ok::<_, Infallible>(extender.handle(request).await) }
            });
            let _ = crate::extender::http1_server()
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                .await;
        });
    }
}

/// The HTTP/1 server every listener uses: a client has 5 s to send its request
/// headers, so idle connections cannot pile up until file descriptors run out.
pub(crate) fn http1_server() -> hyper::server::conn::http1::Builder {
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(std::time::Duration::from_secs(5));
    builder
}

mod wire;

#[cfg(test)]
mod fixtures;

#[cfg(test)]
mod tests;

#[cfg(test)]
mod tentative_tests;

#[cfg(test)]
mod score_memo_tests;

#[cfg(test)]
mod encode_tests;

#[cfg(test)]
mod wire_tests;

#[cfg(test)]
mod preempt_tests;

#[cfg(test)]
mod candidates_tests;
