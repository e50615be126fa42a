//! The extender: filter, prioritize, preempt and bind as kube-scheduler calls them
//! ([`crate::protocol`] has their types), over the ledger. Filter and prioritize
//! hold the GPUs of the node they expect kube-scheduler to choose tentatively
//! (docs/bind.md), so the next cycles see them taken. `binder` owns the bind
//! path's I/O and `routes` the HTTP routing and probes.

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
use crate::protocol::{
    ExtenderArgs, ExtenderBindingArgs, ExtenderBindingResult, ExtenderFilterResult,
    ExtenderPreemptionArgs, ExtenderPreemptionResult, FilterAnswer, HostPriority, HostScore,
    MetaPod, MetaVictims, Name, NodeList, candidate_names, encode_filter, encode_scores, wire,
};
use tessera_allocator::allocate::{
    DryRun, PodPlacement, Policy, allocate_pod, gpu_victims, group_elsewhere, group_home,
    group_over_allowance, node_victims, score_pod_loaded, selected_nowhere,
};
use tessera_allocator::ledger::{Ledger, annotation_of, pod_name};

mod fits;
use fits::{Fingerprint, FitMemo, Verdict};

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
    /// Filter's verdicts kept across calls ([`fits`]), for the last few pod
    /// shapes, the latest first; with `--candidates 1` only.
    fits: Arc<Mutex<fits::FitMemos>>,
    /// Hashes a call's names for [`fits`], seeded per process.
    name_hasher: foldhash::fast::RandomState,
    /// Whether [`fits`] answers calls (tests compare it with the full judgement).
    fit_memo: bool,
    /// How many filter calls [`fits`] answered.
    fits_served: Arc<AtomicU64>,
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
    /// The names filter let through, in its order.
    names: fits::JoinedNames,
    /// Their scores, in the same order.
    scores: Vec<Option<i64>>,
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
        let mut joined = fits::JoinedNames::with_capacity(names.len());
        for name in names {
            joined.push(name);
        }
        Self {
            uid: uid.to_owned(),
            request: request.clone(),
            generation,
            names: joined,
            scores: scores.to_vec(),
        }
    }

    /// The score filter gave `name`, if it was the `index`-th name it let through
    /// (kube-scheduler passes them on in filter's order; any other is scored anew).
    fn score(&self, index: usize, name: &str) -> Option<Option<i64>> {
        let score = *self.scores.get(index)?;
        (self.names.get(index) == Some(name)).then_some(score)
    }
}

use tessera_daemon::sync::lock;

/// Why a node whose switch to the runtime proxy is unproven takes no GPU pod.
pub const SWITCH_UNPROVEN_WHY: &str = "the node's switch to tessera-runtime-proxy is not proven yet (taint tessera.io/runtime-proxy, or kubelet not connected to the proxy: Device CR tessera.io/switch-unproven, tessera-reporter's log says which): no GPU hook runs there to hold a grant; it takes GPU pods once tessera node switch-over (or the node installer) has proven it and kubelet calls through the proxy";
/// Why filter refuses every node while the cluster cache is not synced.
pub const NOT_SYNCED: &str = "tessera-scheduler's cluster cache is not synced (starting, relisting or reconnecting a watch): no node is judged from a partial view; retry";

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
        lock(&ledger).set_in_flight_ttl(config.reservation_ttl.as_secs());
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
            fits: Arc::default(),
            name_hasher: foldhash::fast::RandomState::default(),
            fit_memo: true,
            fits_served: Arc::default(),
        }
    }

    /// How many filter calls were answered from kept verdicts.
    pub fn kept_verdict_answers(&self) -> u64 {
        self.fits_served.load(Ordering::Relaxed)
    }

    /// Judges every filter call in full, keeping no verdicts across calls: the
    /// baseline `tessera-bench extender` measures kept verdicts against.
    pub fn without_kept_verdicts(mut self) -> Self {
        self.fit_memo = false;
        self
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
        lock(&self.ledger)
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
        // Verdicts kept across calls answer this one when it asks what the last
        // did over the same names ([`fits`]): deploy's one candidate, no group.
        let mut memo_entries =
            (self.fit_memo && self.config.candidates == 1 && request.sharing_group.is_none())
                .then(|| lock(&self.fits).worth_hashing(&request, names.len()))
                .flatten();
        let memo_hashes = memo_entries
            .is_some()
            .then(|| fits::hashes(&self.name_hasher, names.iter().map(|n| n.0.as_ref())));
        let generation = 'judged: {
            let mut ledger = self.ledger();
            // A new cycle of this pod: its earlier choice is not one any more, and
            // an earlier attempt's hold does not count against the pod itself.
            let aside = uid.and_then(|uid| {
                ledger.release_tentative(uid);
                ledger.set_aside(uid)
            });
            if let Some(hashes) = &memo_hashes {
                let mut memos = lock(&self.fits);
                if let Some(memo) = memos.serving(&request, &ledger, Fingerprint::of(hashes)) {
                    memo.refresh(&ledger, &self.config);
                    if let Some(answer) = memo.answer(names, hashes) {
                        self.fits_served.fetch_add(1, Ordering::Relaxed);
                        result.failed_nodes.extend(answer.failed);
                        result
                            .failed_and_unresolvable_nodes
                            .extend(answer.unresolvable);
                        fit.extend(answer.chosen.map(|(name, _)| name));
                        scores.extend(answer.chosen.map(|(_, score)| Some(score)));
                        if let Some(unused) = memo_entries.take() {
                            memos.recycle(unused);
                        }
                        ledger.put_back(aside);
                        break 'judged ledger.generation();
                    }
                }
            }
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
                .map(|name| ledger.loaded_node_slot(name.0.as_ref()))
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
                let slot = found.as_ref().map(|(slot, _)| *slot);
                let verdict = fits::judge(
                    &ledger,
                    name,
                    found.map(|(_, node)| node),
                    &request,
                    &self.config,
                );
                if let Some(entries) = &mut memo_entries {
                    entries.push(name, slot, verdict.clone());
                }
                match verdict {
                    Verdict::Fit(score) => {
                        fit.push(name);
                        scores.push(Some(score));
                    }
                    // The reason's words go on the wire.
                    Verdict::Failed(why) => {
                        result.failed_nodes.insert(name, why);
                    }
                    Verdict::Unresolvable(why) => {
                        result.failed_and_unresolvable_nodes.insert(name, why);
                    }
                }
            }
            // The verdicts hold at this generation: the pod's own hold put back
            // next counts as a change, so the next call judges that node again.
            let judged_at = ledger.generation();
            if let (Some(hashes), Some(entries)) = (memo_hashes, memo_entries.take()) {
                let memo = FitMemo::new(&request, &ledger, judged_at, hashes, entries);
                lock(&self.fits).keep(memo);
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
}

/// The `keep` best-scored of the nodes that fit (`fit`, with their `scores`), in
/// their order: among equal scores the first ones, which kube-scheduler would
/// have preferred too. `keep` 0, or no more than `keep` nodes: all of them.
fn best_of(fit: Vec<&str>, scores: Vec<Option<i64>>, keep: usize) -> (Vec<&str>, Vec<Option<i64>>) {
    if keep == 0 || fit.len() <= keep {
        return (fit, scores);
    }
    if keep == 1 {
        // deploy's setting: one pass, no index to order (ties: the earliest).
        let best = (0..fit.len())
            .max_by_key(|&i| (scores.get(i).copied().flatten(), std::cmp::Reverse(i)));
        return match best.and_then(|i| Some((*fit.get(i)?, scores.get(i).copied().flatten()))) {
            Some((name, score)) => (vec![name], vec![score]),
            None => (Vec::new(), Vec::new()),
        };
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

pub(crate) mod binder;
pub(crate) mod routes;

pub use binder::{FORWARD_TIMEOUT, FORWARDED_HEADER};
use binder::{Forwarder, RunningBind};
pub(crate) use routes::http1_server;
pub use routes::{MAX_BODY_BYTES, serve, verb};

#[cfg(test)]
mod fixtures;

#[cfg(test)]
mod tests;

#[cfg(test)]
mod tentative_tests;

#[cfg(test)]
mod score_memo_tests;

#[cfg(test)]
mod fits_tests;

#[cfg(test)]
mod encode_tests;

#[cfg(test)]
mod wire_tests;

#[cfg(test)]
mod preempt_tests;

#[cfg(test)]
mod candidates_tests;
