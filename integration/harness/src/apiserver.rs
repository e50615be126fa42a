//! An API server double: the Kubernetes REST + watch JSON over real HTTP, enough
//! for kube-rs clients, reflectors and controllers: list (with resourceVersion and
//! field/label selectors), watch streams (replaying from a resourceVersion), get,
//! create, replace, merge / strategic / JSON / apply patches, delete, the status
//! subresource and pods/binding. Objects are kept as JSON, any group or kind.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, StreamBody, combinators::UnsyncBoxBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::broadcast;

type Body = UnsyncBoxBody<Bytes, Infallible>;

/// Which collection: `(group/version, plural)`; core is `v1`.
type Collection = (String, String);
/// An object's key: collection, namespace ("" for cluster-scoped), name.
type Key = (Collection, String, String);

/// The store's key of object `name` in `namespace` ("" when cluster-scoped).
fn object_key(group_version: &str, plural: &str, namespace: &str, name: &str) -> Key {
    (
        (group_version.to_owned(), plural.to_owned()),
        namespace.to_owned(),
        name.to_owned(),
    )
}

#[derive(Debug, Clone)]
struct Event {
    rv: u64,
    key: Key,
    kind: &'static str,
    object: Value,
}

#[derive(Debug, Default)]
struct Store {
    rv: u64,
    objects: BTreeMap<Key, Value>,
    log: Vec<Event>,
    uid: u64,
}

/// A running API server double.
#[derive(Debug, Clone)]
pub struct ApiServer {
    addr: SocketAddr,
    store: Arc<Mutex<Store>>,
    events: broadcast::Sender<Event>,
    faults: Arc<Faults>,
}

/// Faults a test injects: a slow binding, watches that lag or die.
#[derive(Debug)]
struct Faults {
    /// How long each pods/binding waits before it is applied.
    binding_delay: Mutex<std::time::Duration>,
    /// pods/binding calls taken.
    bindings: std::sync::atomic::AtomicUsize,
    /// The status every pods/binding gets instead of being applied (none: applied).
    binding_failure: Mutex<Option<u16>>,
    /// While true, watch streams hold their events back (watch lag).
    watches_held: tokio::sync::watch::Sender<bool>,
    /// Bumped to end every open watch stream.
    watches_cut: tokio::sync::watch::Sender<u64>,
    /// While true, new watch requests are refused (a dead watch).
    watches_refused: std::sync::atomic::AtomicBool,
}

impl Default for Faults {
    fn default() -> Self {
        Self {
            binding_delay: Mutex::default(),
            bindings: std::sync::atomic::AtomicUsize::new(0),
            binding_failure: Mutex::default(),
            watches_held: tokio::sync::watch::Sender::new(false),
            watches_cut: tokio::sync::watch::Sender::new(0),
            watches_refused: std::sync::atomic::AtomicBool::new(false),
        }
    }
}

fn full(status: StatusCode, value: &Value) -> Response<Body> {
    let mut response = Response::new(
        Full::new(Bytes::from(value.to_string()))
            .map_err(|never| match never {})
            .boxed_unsync(),
    );
    *response.status_mut() = status;
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    response
}

fn status(code: StatusCode, reason: &str, message: impl Into<String>) -> Response<Body> {
    let body = json!({"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure",
        "message": message.into(),"reason":reason,"code":code.as_u16()});
    full(code, &body)
}

fn kind_of(plural: &str) -> String {
    match plural {
        "pods" => "Pod".into(),
        "nodes" => "Node".into(),
        "devices" => "Device".into(),
        "leases" => "Lease".into(),
        "events" => "Event".into(),
        "configmaps" => "ConfigMap".into(),
        other => {
            let singular = other.strip_suffix('s').unwrap_or(other);
            let mut chars = singular.chars();
            chars
                .next()
                .map(|c| c.to_uppercase().collect::<String>() + chars.as_str())
                .unwrap_or_default()
        }
    }
}

/// RFC 7386 JSON merge patch.
pub fn merge_patch(target: &mut Value, patch: &Value) {
    match patch {
        Value::Object(fields) => {
            if !target.is_object() {
                *target = json!({});
            }
            if let Value::Object(map) = target {
                for (key, value) in fields {
                    if value.is_null() {
                        map.remove(key);
                    } else {
                        merge_patch(map.entry(key.clone()).or_insert(Value::Null), value);
                    }
                }
            }
        }
        other => *target = other.clone(),
    }
}

fn pointer_parts(path: &str) -> Vec<String> {
    path.split('/')
        .skip(1)
        .map(|p| p.replace("~1", "/").replace("~0", "~"))
        .collect()
}

/// RFC 6902 JSON patch: add, replace, remove, test.
pub fn json_patch(target: &mut Value, ops: &Value) -> Result<(), String> {
    for op in ops.as_array().ok_or("JSON patch must be a list")? {
        let path = op["path"].as_str().ok_or("op without path")?;
        let parts = pointer_parts(path);
        let (last, parents) = parts.split_last().ok_or("empty path")?;
        let parent_path: String = parents
            .iter()
            .map(|p| format!("/{}", p.replace('~', "~0").replace('/', "~1")))
            .collect();
        match op["op"].as_str() {
            Some("test") => {
                if target.pointer(path) != Some(&op["value"]) {
                    return Err(format!("test failed at {path}"));
                }
            }
            Some(kind @ ("add" | "replace" | "remove")) => {
                let parent = target
                    .pointer_mut(&parent_path)
                    .ok_or(format!("no parent for {path}"))?;
                match (parent, kind) {
                    (Value::Object(map), "remove") => {
                        map.remove(last).ok_or(format!("nothing at {path}"))?;
                    }
                    (Value::Object(map), _) => {
                        map.insert(last.clone(), op["value"].clone());
                    }
                    (Value::Array(list), kind) => {
                        let index = if last == "-" {
                            list.len()
                        } else {
                            last.parse().map_err(|_| format!("bad index in {path}"))?
                        };
                        match kind {
                            "remove" if index < list.len() => {
                                list.remove(index);
                            }
                            "replace" if index < list.len() => list[index] = op["value"].clone(),
                            "add" if index <= list.len() => list.insert(index, op["value"].clone()),
                            _ => return Err(format!("index out of range in {path}")),
                        }
                    }
                    _ => return Err(format!("cannot patch into a scalar at {path}")),
                }
            }
            other => return Err(format!("unsupported JSON patch op {other:?}")),
        }
    }
    Ok(())
}

fn matches_selectors(object: &Value, query: &BTreeMap<String, String>) -> bool {
    if let Some(fields) = query.get("fieldSelector").filter(|s| !s.is_empty()) {
        for term in fields.split(',') {
            let (path, want, negate) = match term.split_once("!=") {
                Some((p, v)) => (p, v, true),
                None => match term.split_once('=') {
                    Some((p, v)) => (p, v.trim_start_matches('='), false),
                    None => continue,
                },
            };
            let pointer = format!("/{}", path.replace('.', "/"));
            let value = object
                .pointer(&pointer)
                .and_then(Value::as_str)
                .unwrap_or("");
            if (value == want) == negate {
                return false;
            }
        }
    }
    if let Some(labels) = query.get("labelSelector").filter(|s| !s.is_empty()) {
        for term in labels.split(',') {
            let (key, want) = term
                .split_once('=')
                .map_or((term, None), |(k, v)| (k, Some(v.trim_start_matches('='))));
            let value = object["metadata"]["labels"]
                .get(key)
                .and_then(Value::as_str);
            match want {
                Some(want) if value != Some(want) => return false,
                None if value.is_none() => return false,
                _ => {}
            }
        }
    }
    true
}

struct Route {
    collection: Collection,
    namespace: String,
    name: Option<String>,
    subresource: Option<String>,
}

impl Route {
    /// The store key of object `name` in this route's collection and namespace.
    fn key(&self, name: &str) -> Key {
        (
            self.collection.clone(),
            self.namespace.clone(),
            name.to_owned(),
        )
    }
}

fn not_found(route: &Route, name: &str) -> Response<Body> {
    status(
        StatusCode::NOT_FOUND,
        "NotFound",
        format!("{} \"{name}\" not found", route.collection.1),
    )
}

fn route(path: &str) -> Option<Route> {
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group_version, rest) = match parts.as_slice() {
        ["api", version, rest @ ..] => ((*version).to_owned(), rest),
        ["apis", group, version, rest @ ..] => (format!("{group}/{version}"), rest),
        _ => return None,
    };
    let (namespace, rest) = match rest {
        ["namespaces", ns, rest @ ..] if !rest.is_empty() => ((*ns).to_owned(), rest),
        _ => (String::new(), rest),
    };
    let (plural, name, subresource) = match rest {
        [plural] => (*plural, None, None),
        [plural, name] => (*plural, Some((*name).to_owned()), None),
        [plural, name, sub] => (*plural, Some((*name).to_owned()), Some((*sub).to_owned())),
        _ => return None,
    };
    Some(Route {
        collection: (group_version, plural.to_owned()),
        namespace,
        name,
        subresource,
    })
}

impl ApiServer {
    fn lock(&self) -> std::sync::MutexGuard<'_, Store> {
        self.store
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Starts on an ephemeral loopback port.
    pub async fn start() -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let (events, _) = broadcast::channel(4096);
        let server = Self {
            addr: listener.local_addr()?,
            store: Arc::default(),
            events,
            faults: Arc::default(),
        };
        let accept = server.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let server = accept.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |request| {
                        let server = server.clone();
                        async move { Ok::<_, Infallible>(server.handle(request).await) }
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Ok(server)
    }

    /// Fault: every pods/binding waits `delay` before it is applied (and answered).
    pub fn delay_bindings(&self, delay: std::time::Duration) {
        *self
            .faults
            .binding_delay
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = delay;
    }

    /// Fault: every pods/binding is answered `status` (a server error: 500, 503,
    /// 504) and not applied, as when a webhook or etcd timed out; `None` ends it.
    pub fn fail_bindings(&self, status: Option<u16>) {
        *self
            .faults
            .binding_failure
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = status;
    }

    /// How many pods/binding calls the server has taken.
    pub fn bindings(&self) -> usize {
        self.faults
            .bindings
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Fault: while `held`, open watch streams send nothing (events wait, in order).
    pub fn hold_watches(&self, held: bool) {
        self.faults.watches_held.send_replace(held);
    }

    /// Fault: ends every open watch stream and, while `refused`, answers new watch
    /// requests with 500 (a watch that cannot be re-established).
    pub fn cut_watches(&self, refused: bool) {
        self.faults
            .watches_refused
            .store(refused, std::sync::atomic::Ordering::SeqCst);
        self.faults.watches_cut.send_modify(|n| *n += 1);
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A kube client for this server.
    pub fn client(&self) -> anyhow::Result<kube::Client> {
        let config = kube::Config::new(self.url().parse()?);
        Ok(kube::Client::try_from(config)?)
    }

    /// Writes a kubeconfig pointing at this server; returns its path.
    pub fn write_kubeconfig(&self, dir: &std::path::Path) -> anyhow::Result<std::path::PathBuf> {
        let path = dir.join("kubeconfig");
        std::fs::write(
            &path,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: double\n  cluster:\n    server: {}\ncontexts:\n- name: double\n  context:\n    cluster: double\n    user: nobody\ncurrent-context: double\nusers:\n- name: nobody\n  user: {{}}\n",
                self.url()
            ),
        )?;
        Ok(path)
    }

    /// Puts an object directly (as if created through the API); returns it as stored.
    pub fn insert(&self, group_version: &str, plural: &str, object: Value) -> Value {
        let namespace = object["metadata"]["namespace"].as_str().unwrap_or("");
        let name = object["metadata"]["name"].as_str().unwrap_or("");
        let key = object_key(group_version, plural, namespace, name);
        let mut store = self.lock();
        self.write(&mut store, key, object, true)
    }

    /// An object as stored, if present.
    pub fn get(
        &self,
        group_version: &str,
        plural: &str,
        namespace: &str,
        name: &str,
    ) -> Option<Value> {
        let key = object_key(group_version, plural, namespace, name);
        self.lock().objects.get(&key).cloned()
    }

    /// How many writes the server has taken (its resourceVersion).
    pub fn resource_version(&self) -> u64 {
        self.lock().rv
    }

    /// Deletes an object directly.
    pub fn remove(
        &self,
        group_version: &str,
        plural: &str,
        namespace: &str,
        name: &str,
    ) -> Option<Value> {
        let key = object_key(group_version, plural, namespace, name);
        let mut store = self.lock();
        let object = store.objects.remove(&key)?;
        store.rv += 1;
        let event = Event {
            rv: store.rv,
            key,
            kind: "DELETED",
            object: object.clone(),
        };
        store.log.push(event.clone());
        let _ = self.events.send(event);
        Some(object)
    }

    fn write(&self, store: &mut Store, key: Key, mut object: Value, create: bool) -> Value {
        store.rv += 1;
        let rv = store.rv;
        if create {
            store.uid += 1;
            let uid = format!("00000000-0000-4000-8000-{:012x}", store.uid);
            let metadata = &mut object["metadata"];
            if metadata.get("uid").and_then(Value::as_str).is_none() {
                metadata["uid"] = uid.into();
            }
            metadata["creationTimestamp"] = "2026-01-01T00:00:00Z".into();
        }
        object["metadata"]["resourceVersion"] = rv.to_string().into();
        let existed = store.objects.insert(key.clone(), object.clone()).is_some();
        let event = Event {
            rv,
            key,
            kind: if existed { "MODIFIED" } else { "ADDED" },
            object: object.clone(),
        };
        store.log.push(event.clone());
        let _ = self.events.send(event);
        object
    }

    async fn handle(&self, request: Request<Incoming>) -> Response<Body> {
        let query: BTreeMap<String, String> = request
            .uri()
            .query()
            .map(|q| {
                q.split('&')
                    .filter_map(|pair| pair.split_once('='))
                    .map(|(k, v)| (k.to_owned(), percent_decode(v)))
                    .collect()
            })
            .unwrap_or_default();
        let Some(route) = route(request.uri().path()) else {
            return status(
                StatusCode::NOT_FOUND,
                "NotFound",
                format!("no route for {}", request.uri().path()),
            );
        };
        let method = request.method().clone();
        let content_type = request
            .headers()
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned();
        let body = match request.into_body().collect().await {
            Ok(body) => body.to_bytes(),
            Err(error) => return status(StatusCode::BAD_REQUEST, "BadRequest", error.to_string()),
        };
        let parsed: Option<Value> = if body.is_empty() {
            None
        } else {
            serde_json::from_slice(&body).ok()
        };
        if !body.is_empty() && parsed.is_none() {
            return status(StatusCode::BAD_REQUEST, "BadRequest", "body is not JSON");
        }
        match (&method, &route.name, route.subresource.as_deref()) {
            (&Method::GET, None, _)
                if query.get("watch").is_some_and(|w| w == "true" || w == "1") =>
            {
                self.watch(&route, &query)
            }
            (&Method::GET, None, _) => self.list(&route, &query),
            (&Method::POST, None, _) => self.create(&route, parsed),
            (&Method::POST, Some(name), Some("binding")) => {
                self.faults
                    .bindings
                    .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let delay = *self
                    .faults
                    .binding_delay
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                tokio::time::sleep(delay).await;
                let failure = *self
                    .faults
                    .binding_failure
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                match failure.and_then(|code| StatusCode::from_u16(code).ok()) {
                    Some(code) => status(code, "Timeout", "the binding was not applied in time"),
                    None => self.bind(&route, name, parsed),
                }
            }
            (&Method::GET, Some(name), _) => match self.get(
                &route.collection.0,
                &route.collection.1,
                &route.namespace,
                name,
            ) {
                Some(object) => full(StatusCode::OK, &object),
                None => not_found(&route, name),
            },
            (&Method::PUT, Some(name), sub) => self.replace(&route, name, sub, parsed),
            (&Method::PATCH, Some(name), sub) => {
                self.patch(&route, name, sub, &content_type, parsed)
            }
            (&Method::DELETE, Some(name), _) => match self.remove(
                &route.collection.0,
                &route.collection.1,
                &route.namespace,
                name,
            ) {
                Some(object) => full(StatusCode::OK, &object),
                None => not_found(&route, name),
            },
            _ => status(
                StatusCode::METHOD_NOT_ALLOWED,
                "MethodNotAllowed",
                format!("{method} not supported here"),
            ),
        }
    }

    fn in_scope(route: &Route, key: &Key) -> bool {
        key.0 == route.collection && (route.namespace.is_empty() || key.1 == route.namespace)
    }

    fn list(&self, route: &Route, query: &BTreeMap<String, String>) -> Response<Body> {
        let store = self.lock();
        let items: Vec<Value> = store
            .objects
            .iter()
            .filter(|(key, object)| Self::in_scope(route, key) && matches_selectors(object, query))
            .map(|(_, object)| object.clone())
            .collect();
        let kind = format!("{}List", kind_of(&route.collection.1));
        full(
            StatusCode::OK,
            &json!({"apiVersion": route.collection.0, "kind": kind, "metadata": {"resourceVersion": store.rv.to_string()}, "items": items}),
        )
    }

    fn watch(&self, route: &Route, query: &BTreeMap<String, String>) -> Response<Body> {
        if self
            .faults
            .watches_refused
            .load(std::sync::atomic::Ordering::SeqCst)
        {
            return status(
                StatusCode::INTERNAL_SERVER_ERROR,
                "InternalError",
                "watches refused (injected fault)",
            );
        }
        let mut held = self.faults.watches_held.subscribe();
        let mut cut = self.faults.watches_cut.subscribe();
        let since: u64 = query
            .get("resourceVersion")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let scope = Route {
            collection: route.collection.clone(),
            namespace: route.namespace.clone(),
            name: None,
            subresource: None,
        };
        // Subscribe before reading the log, so nothing falls between them.
        let mut live = self.events.subscribe();
        let backlog: Vec<Event> = {
            let store = self.lock();
            store.log.iter().filter(|e| e.rv > since).cloned().collect()
        };
        let query = query.clone();
        let last = backlog.last().map_or(since, |e| e.rv);
        let timeout = std::time::Duration::from_secs(
            query
                .get("timeoutSeconds")
                .and_then(|t| t.parse().ok())
                .unwrap_or(290),
        );
        let stream = async_stream(move |tx| async move {
            let send = |event: &Event| {
                if Self::in_scope(&scope, &event.key) && matches_selectors(&event.object, &query) {
                    let line =
                        json!({"type": event.kind, "object": event.object}).to_string() + "\n";
                    tx.send(Frame::data(Bytes::from(line))).is_ok()
                } else {
                    true
                }
            };
            for event in &backlog {
                if !send(event) {
                    return;
                }
            }
            let deadline = tokio::time::sleep(timeout);
            tokio::pin!(deadline);
            loop {
                tokio::select! {
                    _ = cut.changed() => return,
                    received = live.recv() => match received {
                        Ok(event) if event.rv > last => {
                            // Watch lag: an event waits while watches are held.
                            if held.wait_for(|held| !*held).await.is_err() || !send(&event) {
                                return;
                            }
                        }
                        Ok(_) => {}
                        Err(broadcast::error::RecvError::Lagged(_)) => return,
                        Err(broadcast::error::RecvError::Closed) => return,
                    },
                    () = &mut deadline => return,
                }
            }
        });
        let mut response = Response::new(stream);
        response.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        );
        response
    }

    fn create(&self, route: &Route, body: Option<Value>) -> Response<Body> {
        let Some(mut object) = body else {
            return status(StatusCode::BAD_REQUEST, "BadRequest", "no body");
        };
        let Some(name) = object["metadata"]["name"].as_str().map(str::to_owned) else {
            return status(
                StatusCode::UNPROCESSABLE_ENTITY,
                "Invalid",
                "metadata.name: Required value",
            );
        };
        if !route.namespace.is_empty() {
            object["metadata"]["namespace"] = route.namespace.clone().into();
        }
        let key = (
            route.collection.clone(),
            route.namespace.clone(),
            name.clone(),
        );
        let mut store = self.lock();
        if store.objects.contains_key(&key) {
            return status(
                StatusCode::CONFLICT,
                "AlreadyExists",
                format!("{} \"{name}\" already exists", route.collection.1),
            );
        }
        let stored = self.write(&mut store, key, object, true);
        full(StatusCode::CREATED, &stored)
    }

    /// A Conflict response when `incoming` names a resourceVersion that is not the current one.
    fn version_conflict(existing: &Value, incoming: &Value, name: &str) -> Option<Response<Body>> {
        match incoming["metadata"]["resourceVersion"].as_str() {
            Some(rv) if Some(rv) != existing["metadata"]["resourceVersion"].as_str() => {
                Some(status(
                    StatusCode::CONFLICT,
                    "Conflict",
                    format!(
                        "Operation cannot be fulfilled on \"{name}\": the object has been modified; please apply your changes to the latest version and try again"
                    ),
                ))
            }
            _ => None,
        }
    }

    /// A Conflict response when a UID precondition (`uid`, when a string) is not the object's UID.
    fn uid_conflict(existing: &Value, uid: &Value) -> Option<Response<Body>> {
        let wanted = uid.as_str()?;
        let found = existing["metadata"]["uid"].as_str().unwrap_or("");
        (wanted != found).then(|| {
            status(
                StatusCode::CONFLICT,
                "Conflict",
                format!(
                    "Precondition failed: UID in precondition: {wanted}, UID in object meta: {found}"
                ),
            )
        })
    }

    fn replace(
        &self,
        route: &Route,
        name: &str,
        sub: Option<&str>,
        body: Option<Value>,
    ) -> Response<Body> {
        let Some(incoming) = body else {
            return status(StatusCode::BAD_REQUEST, "BadRequest", "no body");
        };
        let key = route.key(name);
        let mut store = self.lock();
        let Some(existing) = store.objects.get(&key).cloned() else {
            return not_found(route, name);
        };
        if let Some(response) = Self::version_conflict(&existing, &incoming, name) {
            return response;
        }
        let updated = match sub {
            Some("status") => {
                let mut updated = existing;
                updated["status"] = incoming["status"].clone();
                updated
            }
            _ => {
                let mut updated = incoming;
                updated["metadata"]["uid"] = existing["metadata"]["uid"].clone();
                updated["metadata"]["creationTimestamp"] =
                    existing["metadata"]["creationTimestamp"].clone();
                if !existing["status"].is_null() {
                    updated["status"] = existing["status"].clone();
                }
                updated
            }
        };
        full(StatusCode::OK, &self.write(&mut store, key, updated, false))
    }

    fn patch(
        &self,
        route: &Route,
        name: &str,
        sub: Option<&str>,
        content_type: &str,
        body: Option<Value>,
    ) -> Response<Body> {
        let Some(patch) = body else {
            return status(StatusCode::BAD_REQUEST, "BadRequest", "no body");
        };
        let key = route.key(name);
        let mut store = self.lock();
        let apply = content_type.starts_with("application/apply-patch");
        let existing = match store.objects.get(&key).cloned() {
            Some(existing) => existing,
            None if apply && sub.is_none() => {
                let mut object = patch.clone();
                if !route.namespace.is_empty() {
                    object["metadata"]["namespace"] = route.namespace.clone().into();
                }
                return full(
                    StatusCode::CREATED,
                    &self.write(&mut store, key, object, true),
                );
            }
            None => {
                return not_found(route, name);
            }
        };
        if let Some(response) = Self::version_conflict(&existing, &patch, name) {
            return response;
        }
        if let Some(response) = Self::uid_conflict(&existing, &patch["metadata"]["uid"]) {
            return response;
        }
        let mut updated = existing.clone();
        if content_type.starts_with("application/json-patch+json") {
            if let Err(problem) = json_patch(&mut updated, &patch) {
                return status(StatusCode::UNPROCESSABLE_ENTITY, "Invalid", problem);
            }
        } else {
            // merge, strategic merge (approximated by merge) and server-side apply
            merge_patch(&mut updated, &patch);
        }
        match sub {
            Some("status") => {
                let mut only_status = existing.clone();
                only_status["status"] = updated["status"].clone();
                updated = only_status;
            }
            _ => {
                // The main resource does not change status.
                updated["status"] = existing["status"].clone();
                if updated["status"].is_null() {
                    if let Value::Object(map) = &mut updated {
                        map.remove("status");
                    }
                }
            }
        }
        updated["metadata"]["uid"] = existing["metadata"]["uid"].clone();
        full(StatusCode::OK, &self.write(&mut store, key, updated, false))
    }

    fn bind(&self, route: &Route, name: &str, body: Option<Value>) -> Response<Body> {
        let Some(node) = body
            .as_ref()
            .and_then(|b| b["target"]["name"].as_str())
            .map(str::to_owned)
        else {
            return status(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                "binding without target.name",
            );
        };
        let key = route.key(name);
        let mut store = self.lock();
        let Some(mut pod) = store.objects.get(&key).cloned() else {
            return status(
                StatusCode::NOT_FOUND,
                "NotFound",
                format!("pods \"{name}\" not found"),
            );
        };
        if let Some(response) = body.as_ref().and_then(|b| {
            Self::uid_conflict(&pod, &b["metadata"]["uid"])
                .or_else(|| Self::version_conflict(&pod, b, name))
        }) {
            return response;
        }
        if pod["spec"]["nodeName"]
            .as_str()
            .is_some_and(|n| !n.is_empty())
        {
            return status(
                StatusCode::CONFLICT,
                "Conflict",
                format!(
                    "pod {name} is already assigned to node \"{}\"",
                    pod["spec"]["nodeName"]
                ),
            );
        }
        pod["spec"]["nodeName"] = node.into();
        // As kube-apiserver's binding registry: the Binding's annotations are
        // merged into the pod in the same write.
        if let Some(Value::Object(annotations)) =
            body.as_ref().map(|b| b["metadata"]["annotations"].clone())
        {
            if !pod["metadata"]["annotations"].is_object() {
                pod["metadata"]["annotations"] = json!({});
            }
            for (key, value) in annotations {
                pod["metadata"]["annotations"][key] = value;
            }
        }
        self.write(&mut store, key, pod, false);
        full(
            StatusCode::CREATED,
            &json!({"kind":"Status","apiVersion":"v1","metadata":{},"status":"Success","code":201}),
        )
    }
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3])
                    .ok()
                    .and_then(|h| u8::from_str_radix(h, 16).ok());
                match hex {
                    Some(byte) => {
                        out.push(byte);
                        i += 3;
                    }
                    None => {
                        out.push(b'%');
                        i += 1;
                    }
                }
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            byte => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A body fed by a task through a channel.
fn async_stream<F, Fut>(producer: F) -> Body
where
    F: FnOnce(tokio::sync::mpsc::UnboundedSender<Frame<Bytes>>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(producer(tx));
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|frame| (Ok::<_, Infallible>(frame), rx))
    });
    StreamBody::new(stream).boxed_unsync()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patches() {
        let mut doc = json!({"a": 1, "b": {"c": 2, "d": 3}});
        merge_patch(&mut doc, &json!({"b": {"c": null, "e": 4}, "f": [1]}));
        assert_eq!(doc, json!({"a": 1, "b": {"d": 3, "e": 4}, "f": [1]}));
        assert!(json_patch(&mut doc, &json!([{"op":"remove","path":"/nope/x"}])).is_err());
        let mut doc = json!({"m": {"k/x": 1}, "l": [1]});
        json_patch(&mut doc, &json!([{"op":"test","path":"/m/k~1x","value":1},{"op":"add","path":"/l/-","value":2},{"op":"remove","path":"/m/k~1x"}])).expect("applies");
        assert_eq!(doc, json!({"m": {}, "l": [1, 2]}));
    }

    #[test]
    fn routes() {
        let r = route("/api/v1/namespaces/default/pods/p1/binding").expect("route");
        assert_eq!(
            (
                r.collection.0.as_str(),
                r.collection.1.as_str(),
                r.namespace.as_str()
            ),
            ("v1", "pods", "default")
        );
        assert_eq!(
            (r.name.as_deref(), r.subresource.as_deref()),
            (Some("p1"), Some("binding"))
        );
        let r = route("/apis/scheduling.koordinator.sh/v1alpha1/devices").expect("route");
        assert_eq!(r.collection.0, "scheduling.koordinator.sh/v1alpha1");
        assert!(r.name.is_none());
        assert_eq!(percent_decode("spec.nodeName%3Dn1"), "spec.nodeName=n1");
    }
}
