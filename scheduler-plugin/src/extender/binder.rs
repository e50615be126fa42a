//! The bind path's I/O: one bind per pod UID at a time, the reservation, the one
//! write (a Binding carrying the allocation), what is held when its outcome is
//! unknown, and a follower's hand-over to the leader. The decisions are
//! [`crate::bind`]'s.

use super::*;

/// How a follower reaches the leader to hand it a bind.
#[derive(Clone)]
pub(super) enum Forwarder {
    /// Plain HTTP (the leader's URL is `http://`): a plain-HTTP extender.
    Plain(HttpClient<HttpConnector, Full<Bytes>>),
    /// HTTPS with this replica's certificate as client certificate, the leader's
    /// verified against the peer CA under a fixed name (it is dialled by pod IP).
    Tls(HttpClient<HttpsConnector<HttpConnector>, Full<Bytes>>),
}

impl Forwarder {
    pub(super) async fn request(
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
pub(super) type RunningBind = Shared<BoxFuture<'static, ExtenderBindingResult>>;

/// Removes a pod's running bind from the map when the bind's task ends.
struct BindDone(Arc<Mutex<HashMap<String, (String, RunningBind)>>>, String);

impl Drop for BindDone {
    fn drop(&mut self) {
        lock(&self.0).remove(&self.1);
    }
}

/// Marks a bind a follower handed to the leader, so it is never handed on again.
pub const FORWARDED_HEADER: &str = "x-tessera-forwarded";

/// How long a follower waits for the leader to bind: well inside kube-scheduler's
/// extender `httpTimeout` (5 s in deploy/scheduler-config.yaml), so the follower
/// answers before kube-scheduler gives up and retries while the bind still runs.
pub const FORWARD_TIMEOUT: Duration = Duration::from_secs(4);

impl Extender {
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
    pub(super) async fn bind_once(&self, args: &ExtenderBindingArgs) -> Result<(), BindFailure> {
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
    pub(super) fn reserve(
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
    pub(super) fn choose_for_bind(
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
            reason: reason.to_string(),
        })
    }

    /// Holds what pod `uid` holds, as read, when it is bound with an allocation
    /// ([`Ledger::hold_bound`]; nothing when the watch has shown it already).
    pub(super) fn hold_as_bound(&self, uid: &str, pod: &Pod) {
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
    pub(super) async fn create_binding(
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
    pub(super) async fn forward_bind(
        &self,
        url: &str,
        args: &ExtenderBindingArgs,
    ) -> ExtenderBindingResult {
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
}
