use std::sync::{Arc, Mutex};

use super::*;
use tessera_daemon::sync::lock;

const ID_A: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
const ID_B: &str = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";
const GPU: &str = "GPU-0";

/// A node of processes (pid → container ID), a freezer recording what it was
/// told, and a GPU whose processes use it fully unless frozen, with `queued`
/// seconds of work still running after a freeze.
#[derive(Clone, Default)]
struct Node {
    frozen: Arc<Mutex<HashMap<PathBuf, bool>>>,
    /// When each cgroup was last frozen (simulated seconds).
    frozen_at: Arc<Mutex<HashMap<PathBuf, f64>>>,
    calls: Arc<Mutex<Vec<(PathBuf, bool)>>>,
    pids: Arc<Mutex<HashMap<u32, (String, f64)>>>, // pid → (container ID, demand 0..1)
    now: Arc<Mutex<f64>>,
    queued: f64,
    /// Errors the freezer answers with, first to last, before it works again.
    failures: Arc<Mutex<Vec<std::io::ErrorKind>>>,
}

fn dir_of(id: &str) -> PathBuf {
    PathBuf::from(format!("/cg/kubepods/pod/cri-containerd-{id}.scope"))
}

impl Node {
    fn add(&self, pid: u32, id: &str, demand: f64) {
        self.pids
            .lock()
            .expect("test setup")
            .insert(pid, (id.to_owned(), demand));
    }
    fn is_frozen(&self, id: &str) -> bool {
        self.frozen
            .lock()
            .expect("test setup")
            .get(&dir_of(id))
            .copied()
            .unwrap_or(false)
    }
}

struct NodeGpu(Node);
impl GpuTime for NodeGpu {
    fn samples(&mut self, _uuid: &str, since_us: u64) -> Result<Vec<Sample>, ThrottleError> {
        let now = *self
            .0
            .now
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let timestamp_us = (now * 1e6) as u64;
        if timestamp_us <= since_us {
            return Ok(Vec::new());
        }
        let frozen = self
            .0
            .frozen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        let frozen_at = self
            .0
            .frozen_at
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        Ok(self
            .0
            .pids
            .lock()
            .expect("test setup")
            .iter()
            .map(|(pid, (id, demand))| {
                let dir = dir_of(id);
                let running = !frozen.get(&dir).copied().unwrap_or(false)
                    || frozen_at
                        .get(&dir)
                        .is_some_and(|at| now - at < self.0.queued);
                Sample {
                    pid: *pid,
                    timestamp_us,
                    sm_percent: if running { (demand * 100.0) as u32 } else { 0 },
                }
            })
            .collect())
    }
}

struct NodeProcesses(Node);
impl Processes for NodeProcesses {
    fn cgroup(&self, pid: u32) -> Lookup {
        let Some((id, _)) = self
            .0
            .pids
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&pid)
            .cloned()
        else {
            return Lookup::Gone;
        };
        // A process of the node itself: in no container.
        if id == "host" {
            return Lookup::NotContainer;
        }
        Lookup::Container(ProcessCgroup {
            container_id: id.clone(),
            dir: dir_of(&id),
        })
    }
}

struct NodeFreezer(Node);
impl Freezer for NodeFreezer {
    fn set(&self, dir: &Path, frozen: bool) -> std::io::Result<()> {
        let failure = {
            let mut failures = self
                .0
                .failures
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            (!failures.is_empty()).then(|| failures.remove(0))
        };
        if let Some(kind) = failure {
            return Err(std::io::Error::from(kind));
        }
        self.0
            .calls
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push((dir.to_owned(), frozen));
        self.0
            .frozen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(dir.to_owned(), frozen);
        if frozen {
            let now = *self
                .0
                .now
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            self.0
                .frozen_at
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .insert(dir.to_owned(), now);
        }
        Ok(())
    }
}

fn throttle(dir: &Path, node: &Node) -> Throttle {
    Throttle::open(
        dir.to_owned(),
        Box::new(NodeProcesses(node.clone())),
        Box::new(NodeFreezer(node.clone())),
    )
    .expect("test setup")
}

fn grant(id: &str, pod: &str, percent: u64) -> Grant {
    Grant {
        pod_uid: pod.into(),
        container_id: id.into(),
        percent,
        gpus: vec![GPU.into()],
        percents: Vec::new(),
    }
}

/// One 100 ms round of simulated time.
fn round(throttle: &mut Throttle, node: &Node) {
    let now = {
        let mut now = lock(&node.now);
        *now += 0.1;
        *now
    };
    throttle.tick(now, &mut NodeGpu(node.clone()));
}

/// Runs `seconds` of 100 ms rounds; returns the fraction of rounds each of
/// `ids` was thawed (free to run) in.
fn run(throttle: &mut Throttle, node: &Node, seconds: f64, ids: &[&str]) -> Vec<f64> {
    let rounds = (seconds * 10.0) as usize;
    let mut running = vec![0usize; ids.len()];
    for _ in 0..rounds {
        round(throttle, node);
        for (i, id) in ids.iter().enumerate() {
            if !node.is_frozen(id) {
                running[i] += 1;
            }
        }
    }
    running.iter().map(|r| *r as f64 / rounds as f64).collect()
}

#[test]
fn a_container_using_the_whole_gpu_is_held_to_its_share() {
    let dir = tempfile::tempdir().expect("test setup");
    let node = Node::default();
    let mut t = throttle(dir.path(), &node);
    t.grant(grant(ID_A, "pod-a", 25)).expect("test setup");
    node.add(100, ID_A, 1.0);
    let share = run(&mut t, &node, 60.0, &[ID_A])[0];
    assert!(
        (0.22..=0.29).contains(&share),
        "a 25 % container ran {share:.3} of the time"
    );
    let view = &t.accounts()[0];
    assert!(view.frozen_seconds > 40.0, "{view:?}");
}

#[test]
fn work_queued_before_a_freeze_is_charged_so_the_share_holds_over_time() {
    let dir = tempfile::tempdir().expect("test setup");
    let node = Node {
        queued: 0.4,
        ..Node::default()
    };
    let mut t = throttle(dir.path(), &node);
    t.grant(grant(ID_A, "pod-a", 25)).expect("test setup");
    node.add(100, ID_A, 1.0);
    // The GPU ran it while thawed and for 0.4 s after each freeze.
    let thawed = run(&mut t, &node, 120.0, &[ID_A])[0];
    let calls = lock(&node.calls).clone();
    let freezes = calls.iter().filter(|(_, f)| *f).count() as f64;
    let used = thawed + freezes * 0.4 / 120.0;
    assert!(
        (0.2..=0.31).contains(&used),
        "a 25 % container with queued work used {used:.3} of the GPU ({thawed:.3} thawed, {freezes} freezes)"
    );
}

#[test]
fn a_container_within_its_share_and_an_ungranted_one_are_never_frozen() {
    let dir = tempfile::tempdir().expect("test setup");
    let node = Node::default();
    let mut t = throttle(dir.path(), &node);
    t.grant(grant(ID_A, "pod-a", 50)).expect("test setup");
    // Alone on the GPU at 40 % of it, under its 50 %.
    node.add(100, ID_A, 0.4);
    assert_eq!(run(&mut t, &node, 20.0, &[ID_A]), vec![1.0]);
    // Beside it, a whole-GPU container (no grant) and a process of the node.
    node.add(200, ID_B, 1.0);
    node.add(300, "host", 1.0);
    let ran = run(&mut t, &node, 20.0, &[ID_A, ID_B]);
    assert_eq!(ran, vec![1.0, 1.0]);
    assert!(lock(&node.calls).is_empty());
}

#[test]
fn two_tenants_each_get_their_own_share() {
    let dir = tempfile::tempdir().expect("test setup");
    let node = Node::default();
    let mut t = throttle(dir.path(), &node);
    t.grant(grant(ID_A, "pod-a", 20)).expect("test setup");
    t.grant(grant(ID_B, "pod-b", 60)).expect("test setup");
    // Time-sliced: each gets half the GPU while both run.
    node.add(100, ID_A, 0.5);
    node.add(200, ID_B, 0.5);
    let ran = run(&mut t, &node, 60.0, &[ID_A, ID_B]);
    let used_a = ran[0] * 0.5;
    assert!(
        (0.17..=0.23).contains(&used_a),
        "the 20 % tenant used {used_a:.3}"
    );
    // B's demand (0.5) is within its 60 %: never held.
    assert_eq!(ran[1], 1.0);
}

#[test]
fn release_thaws_and_forgets_and_a_pod_goes_whole() {
    let dir = tempfile::tempdir().expect("test setup");
    let node = Node::default();
    let mut t = throttle(dir.path(), &node);
    t.grant(grant(ID_A, "pod-a", 10)).expect("test setup");
    t.grant(grant(ID_B, "pod-a", 10)).expect("test setup");
    node.add(100, ID_A, 1.0);
    run(&mut t, &node, 3.0, &[]);
    assert!(node.is_frozen(ID_A), "{:?}", t.accounts());
    assert!(t.release(ID_A));
    assert!(!node.is_frozen(ID_A));
    assert!(!t.release(ID_A));
    assert!(!dir.path().join(format!("pod-a_{ID_A}")).exists());
    assert!(dir.path().join(format!("pod-a_{ID_B}")).exists());
    assert_eq!(t.release_pod("pod-a"), 1);
    assert_eq!(
        std::fs::read_dir(dir.path()).expect("test setup").count(),
        0
    );
    // Its process goes on using the GPU, unheld.
    run(&mut t, &node, 3.0, &[]);
    assert!(!node.is_frozen(ID_A));
}

#[test]
fn a_restarted_throttle_holds_the_same_containers_and_thaws_what_it_left_frozen() {
    let dir = tempfile::tempdir().expect("test setup");
    let node = Node::default();
    let mut first = throttle(dir.path(), &node);
    first.grant(grant(ID_A, "pod-a", 10)).expect("test setup");
    node.add(100, ID_A, 1.0);
    run(&mut first, &node, 3.0, &[]);
    assert!(node.is_frozen(ID_A));
    drop(first); // killed, not stopped: no thaw_all

    std::fs::write(dir.path().join("junk"), "nothing").expect("test setup");
    std::fs::write(dir.path().join(".pod-a_x.tmp"), "partial").expect("test setup");
    let mut second = throttle(dir.path(), &node);
    assert!(!node.is_frozen(ID_A), "left frozen by the dead throttle");
    assert_eq!(second.accounts().len(), 1);
    let ran = run(&mut second, &node, 30.0, &[ID_A])[0];
    assert!((0.07..=0.14).contains(&ran), "ran {ran:.3} at 10 %");
    second.thaw_all();
    assert!(!node.is_frozen(ID_A));
}

#[test]
fn grants_that_are_not_grants_are_refused_by_name() {
    let dir = tempfile::tempdir().expect("test setup");
    let mut t = throttle(dir.path(), &Node::default());
    let bad = [
        (grant("abc", "pod", 25), "container ID"),
        (grant(&ID_A.to_uppercase(), "pod", 25), "container ID"),
        (grant(ID_A, "../etc", 25), "pod UID"),
        (grant(ID_A, "pod_x", 25), "pod UID"),
        (grant(ID_A, "pod", 0), "percent"),
        (grant(ID_A, "pod", 100), "percent"),
        (
            Grant {
                gpus: vec![],
                ..grant(ID_A, "pod", 25)
            },
            "GPUs",
        ),
    ];
    for (grant, what) in bad {
        let error = t.grant(grant.clone()).expect_err("refused").to_string();
        assert!(error.contains(what), "{grant:?}: {error}");
    }
    assert_eq!(
        std::fs::read_dir(dir.path()).expect("test setup").count(),
        0
    );
}

#[test]
fn container_ids_come_from_the_cgroup_name_of_either_driver() {
    let cases = [
        (format!("/k/pod/cri-containerd-{ID_A}.scope"), Some(ID_A)),
        (format!("/kubepods/burstable/podx/{ID_A}"), Some(ID_A)),
        (format!("/k/crio-{ID_B}.scope"), Some(ID_B)),
        ("/k/pod/cri-containerd-abc.scope".to_owned(), None),
        ("/kubepods.slice".to_owned(), None),
        (format!("/k/{}", ID_A.to_uppercase()), None),
    ];
    for (dir, want) in cases {
        assert_eq!(container_id_of(Path::new(&dir)).as_deref(), want, "{dir}");
    }
}

/// A GPU answering each round with the samples it is given (and no running list).
struct Scripted(Arc<Mutex<Vec<Sample>>>);
impl GpuTime for Scripted {
    fn samples(&mut self, _uuid: &str, since_us: u64) -> Result<Vec<Sample>, ThrottleError> {
        let mut queued = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        Ok(std::mem::take(&mut *queued)
            .into_iter()
            .filter(|s| s.timestamp_us > since_us)
            .collect())
    }
}

#[test]
fn processes_reported_busy_for_the_same_period_share_it() {
    let dir = tempfile::tempdir().expect("test setup");
    let node = Node::default();
    node.add(1, ID_A, 1.0);
    node.add(2, ID_B, 1.0);
    let queue = Arc::new(Mutex::new(Vec::new()));
    let mut gpu = Scripted(Arc::clone(&queue));
    let mut t = Throttle::open(
        dir.path().to_owned(),
        Box::new(NodeProcesses(node.clone())),
        Box::new(NodeFreezer(node.clone())),
    )
    .expect("test setup");
    t.grant(grant(ID_A, "pod-a", 25)).expect("test setup");
    t.grant(grant(ID_B, "pod-b", 25)).expect("test setup");
    let sample = |pid, at: f64| Sample {
        pid,
        timestamp_us: (at * 1e6) as u64,
        sm_percent: 100,
    };
    let push = |samples: Vec<Sample>| {
        *lock(&queue) = samples;
    };
    push(vec![sample(1, 1.0), sample(2, 1.0)]);
    t.tick(1.0, &mut gpu);
    // Both "100 %" over the same 0.1 s: 0.05 s each, not 0.1.
    push(vec![sample(1, 1.1), sample(2, 1.1)]);
    t.tick(1.1, &mut gpu);
    for view in t.accounts() {
        let want = 0.25 * 0.1 - 0.05;
        assert!(
            (view.credit - want).abs() < 1e-9,
            "{}: credit {} want {want}",
            view.container_id,
            view.credit
        );
    }
    // One process alone at 100 %: the whole period is its.
    push(vec![sample(1, 1.2)]);
    t.tick(1.2, &mut gpu);
    let a = t
        .accounts()
        .into_iter()
        .find(|v| v.container_id == ID_A)
        .expect("held");
    assert!(
        (a.credit - (2.0 * 0.025 - 0.05 - 0.1)).abs() < 1e-9,
        "{a:?}"
    );
}

#[test]
fn time_sliced_tenants_reported_busy_at_once_each_get_their_share() {
    // The GPU as the H100 reported it: every process with work on it is "100 %"
    // busy, while time-slicing gives each running one an equal part.
    let dir = tempfile::tempdir().expect("test setup");
    let node = Node::default();
    let mut t = throttle(dir.path(), &node);
    t.grant(grant(ID_A, "pod-a", 25)).expect("test setup");
    t.grant(grant(ID_B, "pod-b", 25)).expect("test setup");
    node.add(100, ID_A, 1.0);
    node.add(200, ID_B, 1.0);
    let (mut used_a, mut used_b) = (0.0, 0.0);
    let rounds = 600;
    for _ in 0..rounds {
        round(&mut t, &node);
        let (a, b) = (!node.is_frozen(ID_A), !node.is_frozen(ID_B));
        let running = f64::from(u8::from(a) + u8::from(b)).max(1.0);
        used_a += f64::from(u8::from(a)) / running / f64::from(rounds);
        used_b += f64::from(u8::from(b)) / running / f64::from(rounds);
    }
    for (name, used) in [("A", used_a), ("B", used_b)] {
        assert!(
            (0.2..=0.3).contains(&used),
            "tenant {name} used {used:.3} of the GPU at 25 %"
        );
    }
}

/// A throttle holding container A at 10 %, busy on the GPU until frozen.
fn frozen_a(dir: &Path) -> (Node, Throttle) {
    let node = Node::default();
    let mut t = throttle(dir, &node);
    t.grant(grant(ID_A, "pod-a", 10)).expect("test setup");
    node.add(100, ID_A, 1.0);
    until_frozen(&mut t, &node, ID_A);
    (node, t)
}

/// Runs until `id` is frozen (at most 5 s of rounds).
fn until_frozen(t: &mut Throttle, node: &Node, id: &str) {
    for _ in 0..50 {
        run(t, node, 0.1, &[]);
        if node.is_frozen(id) {
            return;
        }
    }
    panic!("{id} never frozen: {:?}", t.accounts());
}

#[test]
fn a_thaw_that_fails_at_start_is_tried_again_every_round() {
    let dir = tempfile::tempdir().expect("test setup");
    let (node, first) = frozen_a(dir.path());
    drop(first);
    node.pids.lock().map(|mut p| p.clear()).ok();
    // The kernel refuses twice (the cgroup busy), then thaws.
    *lock(&node.failures) = vec![std::io::ErrorKind::ResourceBusy; 2];
    let mut second = throttle(dir.path(), &node);
    assert!(node.is_frozen(ID_A));
    assert!(second.accounts()[0].frozen, "{:?}", second.accounts());
    run(&mut second, &node, 0.1, &[]);
    assert!(node.is_frozen(ID_A), "the second refusal");
    run(&mut second, &node, 0.1, &[]);
    assert!(!node.is_frozen(ID_A), "never thawed");
}

#[test]
fn a_grant_again_keeps_its_frozen_cgroup_and_release_thaws_it() {
    let dir = tempfile::tempdir().expect("test setup");
    let (node, mut t) = frozen_a(dir.path());
    t.grant(grant(ID_A, "pod-a", 20)).expect("test setup");
    let text =
        std::fs::read_to_string(dir.path().join(format!("pod-a_{ID_A}"))).expect("its grant file");
    assert!(text.contains("cgroup="), "{text}");
    assert!(t.release(ID_A));
    assert!(!node.is_frozen(ID_A));
}

#[test]
fn once_stopped_nothing_is_frozen_again() {
    let dir = tempfile::tempdir().expect("test setup");
    let (node, mut t) = frozen_a(dir.path());
    t.thaw_all();
    assert!(!node.is_frozen(ID_A));
    // A round that was already under way when the proxy stopped.
    run(&mut t, &node, 2.0, &[]);
    assert!(!node.is_frozen(ID_A));
}

#[test]
fn a_cgroup_gone_while_frozen_is_not_retried() {
    let dir = tempfile::tempdir().expect("test setup");
    let (node, mut t) = frozen_a(dir.path());
    // The container exited: its cgroup is gone.
    node.pids.lock().map(|mut p| p.clear()).ok();
    *lock(&node.failures) = vec![std::io::ErrorKind::NotFound];
    let calls = lock(&node.calls).len();
    run(&mut t, &node, 3.0, &[]);
    assert_eq!(lock(&node.calls).len(), calls, "retried a gone cgroup");
    assert!(!t.accounts()[0].frozen);
}

#[test]
fn a_process_in_a_sub_cgroup_is_its_containers() {
    let root = Path::new("/sys/fs/cgroup");
    let container = root.join(format!("kubepods/pod1/cri-containerd-{ID_A}.scope"));
    let want = Some(ProcessCgroup {
        container_id: ID_A.into(),
        dir: container.clone(),
    });
    assert_eq!(container_cgroup(root, &container), want);
    assert_eq!(container_cgroup(root, &container.join("init.scope")), want);
    // A sub-cgroup named after another container is still its own container's.
    assert_eq!(container_cgroup(root, &container.join(ID_B)), want);
    assert_eq!(container_cgroup(root, &root.join("kubepods/pod1")), None);
    assert_eq!(container_cgroup(root, Path::new("/elsewhere")), None);
}

#[test]
fn leftovers_are_thawed_and_removed_and_bad_files_dropped() {
    let dir = tempfile::tempdir().expect("test setup");
    let (node, t) = frozen_a(dir.path());
    drop(t);
    std::fs::write(
        dir.path().join(format!("pod-b_{ID_B}")),
        "percent=25\ngpus=GPU-0\ncgroup=/etc\n",
    )
    .expect("test setup");
    std::fs::write(dir.path().join("junk"), "nothing").expect("test setup");
    assert_eq!(thaw_leftovers(dir.path(), &NodeFreezer(node.clone())), 1);
    assert!(!node.is_frozen(ID_A));
    assert_eq!(std::fs::read_dir(dir.path()).expect("dir").count(), 0);
}

#[test]
fn a_grant_file_that_is_not_one_still_has_its_cgroup_thawed() {
    // A's cgroup frozen, and its file spoilt (a percents= line that does not
    // parse): the file goes, and the cgroup it names is thawed.
    let dir = tempfile::tempdir().expect("test setup");
    let (node, t) = frozen_a(dir.path());
    drop(t);
    assert!(node.is_frozen(ID_A));
    let file = dir.path().join(format!("pod-a_{ID_A}"));
    let text = std::fs::read_to_string(&file).expect("grant file");
    std::fs::write(&file, format!("{text}percents=x\n")).expect("test setup");
    let t = throttle(dir.path(), &node);
    assert!(t.accounts().is_empty());
    assert!(!node.is_frozen(ID_A), "left frozen");
    assert!(!file.exists());
}

/// A GPU listing `running` as its processes, with the samples it is given.
struct Listing(Arc<Mutex<Vec<Sample>>>, Arc<Mutex<Vec<u32>>>);
impl GpuTime for Listing {
    fn samples(&mut self, uuid: &str, since_us: u64) -> Result<Vec<Sample>, ThrottleError> {
        Scripted(Arc::clone(&self.0)).samples(uuid, since_us)
    }
    fn running(&mut self, _uuid: &str) -> Result<Vec<u32>, ThrottleError> {
        Ok(lock(&self.1).clone())
    }
}

#[test]
fn a_process_gone_before_its_samples_is_charged_to_its_container() {
    let dir = tempfile::tempdir().expect("test setup");
    let node = Node::default();
    let (queue, running) = (
        Arc::new(Mutex::new(Vec::new())),
        Arc::new(Mutex::new(Vec::new())),
    );
    let mut gpu = Listing(Arc::clone(&queue), Arc::clone(&running));
    let mut t = throttle(dir.path(), &node);
    t.grant(grant(ID_A, "pod-a", 10)).expect("test setup");
    let at = |s: f64| (s * 1e6) as u64;
    // Round 1: pid 7 of A has a context on the GPU (no work sampled yet); another
    // process's sample starts the GPU's sampling.
    node.add(7, ID_A, 1.0);
    *lock(&running) = vec![7];
    *lock(&queue) = vec![Sample {
        pid: 99,
        timestamp_us: at(1.0),
        sm_percent: 0,
    }];
    t.tick(1.0, &mut gpu);
    // Round 2: it has exited; its last 0.2 s of work (one sampling window) is
    // sampled only now.
    lock(&node.pids).clear();
    *lock(&running) = vec![];
    *lock(&queue) = vec![Sample {
        pid: 7,
        timestamp_us: at(1.2),
        sm_percent: 100,
    }];
    t.tick(1.2, &mut gpu);
    let credit = t.accounts()[0].credit;
    assert!(
        (credit - (0.1 * 0.2 - 0.2)).abs() < 1e-9,
        "the gone process's 0.2 s was not charged to its container: credit {credit}"
    );
}

/// A GPU whose driver fails every call.
struct Failing;
impl GpuTime for Failing {
    fn samples(&mut self, uuid: &str, _since_us: u64) -> Result<Vec<Sample>, ThrottleError> {
        Err(ThrottleError::Nvml {
            uuid: uuid.into(),
            reason: "GPU is lost".into(),
        })
    }
}

#[test]
fn a_gpu_that_cannot_be_sampled_is_counted_until_it_can() {
    let dir = tempfile::tempdir().expect("test setup");
    let node = Node::default();
    let mut t = throttle(dir.path(), &node);
    t.grant(grant(ID_A, "pod-a", 10)).expect("test setup");
    t.tick(1.0, &mut Failing);
    t.tick(1.1, &mut Failing);
    assert_eq!(t.totals().unsampled_gpus, 1);
    t.tick(1.2, &mut NodeGpu(node.clone()));
    assert_eq!(t.totals().unsampled_gpus, 0);
}

/// The GPU as NVML reported it on an H100 (driver 580, `scripts/gpu/nvml-samples-probe.py`,
/// docs/gpu-runs/h100-2026-11-27c/probe-*.json): one sampling instant every 0.2 s for the
/// whole GPU; at each, a sample (99 %) for the one process that held the GPU over the
/// window before it, none for the others; while none runs, a 0 % sample for the one that
/// ran last. Runnable processes take turns in slices of two windows. It also keeps the
/// truth: the seconds each container's processes ran.
#[derive(Clone, Default)]
struct SlicedGpu {
    node: Node,
    state: Arc<Mutex<SlicedState>>,
}

#[derive(Default)]
struct SlicedState {
    next_instant: f64,
    turn: usize,
    in_slice: u32,
    last: Option<u32>,
    ran: HashMap<String, f64>,
    samples: Vec<Sample>,
}

const WINDOW: f64 = 0.2;

impl SlicedGpu {
    fn advance(&self, now: f64) {
        let mut state = lock(&self.state);
        if state.next_instant == 0.0 {
            state.next_instant = now + WINDOW;
        }
        while state.next_instant <= now + 1e-9 {
            let at = state.next_instant;
            let frozen = lock(&self.node.frozen).clone();
            let frozen_at = lock(&self.node.frozen_at).clone();
            let mut runnable: Vec<(u32, String)> = lock(&self.node.pids)
                .iter()
                .filter(|(_, (id, _))| {
                    let dir = dir_of(id);
                    !frozen.get(&dir).copied().unwrap_or(false)
                        || frozen_at
                            .get(&dir)
                            .is_some_and(|t| at - t < self.node.queued)
                })
                .map(|(pid, (id, _))| (*pid, id.clone()))
                .collect();
            runnable.sort();
            if !runnable.is_empty() {
                if state.in_slice >= 2 {
                    state.turn += 1;
                    state.in_slice = 0;
                }
                let (pid, id) = runnable[state.turn % runnable.len()].clone();
                state.in_slice += 1;
                state.last = Some(pid);
                *state.ran.entry(id).or_default() += WINDOW;
                state.samples.push(Sample {
                    pid,
                    timestamp_us: (at * 1e6) as u64,
                    sm_percent: 99,
                });
            } else if let Some(pid) = state.last {
                state.samples.push(Sample {
                    pid,
                    timestamp_us: (at * 1e6) as u64,
                    sm_percent: 0,
                });
            }
            state.next_instant += WINDOW;
        }
    }
}

impl GpuTime for SlicedGpu {
    fn samples(&mut self, _uuid: &str, since_us: u64) -> Result<Vec<Sample>, ThrottleError> {
        let now = *lock(&self.node.now);
        self.advance(now);
        Ok(lock(&self.state)
            .samples
            .iter()
            .filter(|s| s.timestamp_us > since_us)
            .cloned()
            .collect())
    }
}

/// Runs `seconds` of 100 ms rounds against a [`SlicedGpu`]; the fraction of the GPU
/// each of `ids` ran.
fn run_sliced(node: &Node, grants: &[(&str, u64)], pids: &[(u32, &str)], seconds: f64) -> Vec<f64> {
    let dir = tempfile::tempdir().expect("test setup");
    let mut t = throttle(dir.path(), node);
    for (id, percent) in grants {
        t.grant(grant(id, &format!("pod-{id}"), *percent))
            .expect("test setup");
    }
    for (pid, id) in pids {
        node.add(*pid, id, 1.0);
    }
    let mut gpu = SlicedGpu {
        node: node.clone(),
        state: Arc::default(),
    };
    for _ in 0..(seconds * 10.0) as usize {
        let now = {
            let mut now = lock(&node.now);
            *now += 0.1;
            *now
        };
        t.tick(now, &mut gpu);
    }
    let ran = lock(&gpu.state).ran.clone();
    grants
        .iter()
        .map(|(id, _)| ran.get(*id).copied().unwrap_or(0.0) / seconds)
        .collect()
}

#[test]
fn on_a_gpu_sampled_as_the_h100_was_each_share_holds() {
    // Alone, with work queued past each freeze.
    let node = Node {
        queued: 0.05,
        ..Node::default()
    };
    let alone = run_sliced(&node, &[(ID_A, 25)], &[(100, ID_A)], 60.0);
    // Two tenants at once: each its own share, neither starved (the H100 gave the
    // first 0.09 and the second 0.25 when a sample was charged the time since its
    // process's previous one, its freezes included).
    let two = run_sliced(
        &Node::default(),
        &[(ID_A, 25), (ID_B, 25)],
        &[(100, ID_A), (200, ID_B)],
        60.0,
    );
    // Two processes of one container: their sum (the H100 gave 0.13 together).
    let one = run_sliced(
        &Node::default(),
        &[(ID_A, 25)],
        &[(100, ID_A), (101, ID_A)],
        60.0,
    );
    for (what, used) in [
        ("alone", alone[0]),
        ("tenant A of two", two[0]),
        ("tenant B of two", two[1]),
        ("two processes of one container", one[0]),
    ] {
        assert!(
            (0.2..=0.3).contains(&used),
            "{what}: ran {used:.3} of the GPU at a 25 % share (alone {alone:?}, two {two:?}, one {one:?})"
        );
    }
}

#[test]
fn each_gpu_of_a_grant_is_held_to_its_own_share() {
    // 25 % of GPU-0 and the whole of GPU-1 (a memory-only share there), with a
    // highest share of 50 (another GPU's) that GPU-0 must not be held to: 40 % of
    // GPU-0 is over its share there, 99 % of GPU-1 never is.
    let dir = tempfile::tempdir().expect("test setup");
    let node = Node::default();
    node.add(1, ID_A, 1.0);
    let mut t = throttle(dir.path(), &node);
    let both = Grant {
        gpus: vec!["GPU-0".into(), "GPU-1".into()],
        percents: vec![25, 100],
        ..grant(ID_A, "pod-a", 50)
    };
    assert_eq!(
        (both.percent_on("GPU-0"), both.percent_on("GPU-1")),
        (25, 100)
    );
    t.grant(both.clone()).expect("test setup");
    // Kept whole in its file: a restarted proxy holds the same shares.
    let file = dir.path().join(both.file_name());
    let (read, _) = Grant::from_file(
        &both.file_name(),
        &std::fs::read_to_string(&file).expect("grant file"),
    )
    .expect("parses");
    assert_eq!(read, both);
    // An older proxy's file (no percents): its percent on each GPU.
    let (old, _) =
        Grant::from_file(&both.file_name(), "percent=25\ngpus=GPU-0,GPU-1\n").expect("parses");
    assert_eq!((old.percent_on("GPU-0"), old.percent_on("GPU-1")), (25, 25));
    assert!(
        Grant::from_file(
            &both.file_name(),
            "percent=25\ngpus=GPU-0,GPU-1\npercents=25\n"
        )
        .is_err()
    );

    let samples = |at: f64, gpu0: u32, gpu1: u32| -> Vec<GpuSamples> {
        let one = |sm| {
            Ok(vec![Sample {
                pid: 1,
                timestamp_us: (at * 1e6) as u64,
                sm_percent: sm,
            }])
        };
        vec![("GPU-0".into(), one(gpu0)), ("GPU-1".into(), one(gpu1))]
    };
    let frozen_on = |t: &mut Throttle, gpu0: u32, gpu1: u32, from: f64| {
        let mut ever = false;
        for i in 0..50 {
            let at = from + f64::from(i) * 0.2;
            t.apply(at, samples(at, gpu0, gpu1));
            ever |= node.is_frozen(ID_A);
        }
        ever
    };
    assert!(
        !frozen_on(&mut t, 0, 99, 1.0),
        "held on the GPU it may use whole"
    );
    assert!(
        frozen_on(&mut t, 40, 0, 20.0),
        "40 % of GPU-0 went unheld at 25 %"
    );
}

#[test]
fn samples_of_one_instant_stamped_apart_share_its_window() {
    // Two tenants each reported at 50 % of every 0.2 s window, stamped 30 ms
    // apart (a driver that samples processes one after the other): each used half
    // the GPU, twice its 25 % share, and is held.
    let dir = tempfile::tempdir().expect("test setup");
    let node = Node::default();
    node.add(1, ID_A, 1.0);
    node.add(2, ID_B, 1.0);
    let mut t = throttle(dir.path(), &node);
    t.grant(grant(ID_A, "pod-a", 25)).expect("test setup");
    t.grant(grant(ID_B, "pod-b", 25)).expect("test setup");
    let (mut frozen_a, mut frozen_b) = (false, false);
    for i in 1..=50 {
        let at = 1.0 + f64::from(i) * 0.2;
        let sample = |pid, offset: f64| Sample {
            pid,
            timestamp_us: ((at + offset) * 1e6) as u64,
            sm_percent: 50,
        };
        t.apply(
            at + 0.05,
            vec![(GPU.into(), Ok(vec![sample(1, 0.0), sample(2, 0.03)]))],
        );
        frozen_a |= node.is_frozen(ID_A);
        frozen_b |= node.is_frozen(ID_B);
    }
    let credits: Vec<f64> = t.accounts().iter().map(|a| a.credit).collect();
    assert!(
        frozen_a && frozen_b,
        "a tenant over its share was never frozen: credits {credits:?}"
    );
    // Charged about 0.1 s a window each (0.5 of 0.2 s), refilled 0.05: about -0.05
    // a window, far below zero after 50.
    assert!(credits.iter().all(|c| *c < -1.0), "credits {credits:?}");
}
