//! `tessera inspect` and `kubectl tessera inspect` against the API server double.

use std::process::Command;

use serde_json::json;
use tessera_harness::apiserver::ApiServer;

async fn cluster() -> (ApiServer, tempfile::TempDir, std::path::PathBuf) {
    let api = ApiServer::start().await.expect("api");
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../docs/examples/cluster.yaml"
    ))
    .expect("example");
    let snapshot: serde_json::Value = serde_yaml_from(&text);
    for item in snapshot["items"].as_array().expect("items") {
        match item["kind"].as_str() {
            Some("Device") => api.insert(
                "scheduling.koordinator.sh/v1alpha1",
                "devices",
                item.clone(),
            ),
            Some("Pod") => api.insert("v1", "pods", item.clone()),
            Some("Node") => {
                let mut node = item.clone();
                node["metadata"]["labels"] = json!({"node.koordinator.sh/gpu-model": "Tesla-P100"});
                api.insert("v1", "nodes", node)
            }
            _ => continue,
        };
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let kubeconfig = api.write_kubeconfig(dir.path()).expect("kubeconfig");
    (api, dir, kubeconfig)
}

fn serde_yaml_from(text: &str) -> serde_json::Value {
    serde_yaml::from_str(text).expect("YAML")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_table_and_json_through_both_binaries() {
    let (_api, _dir, kubeconfig) = cluster().await;
    let table = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(["inspect", "--kubeconfig"])
        .arg(&kubeconfig)
        .output()
        .expect("runs");
    assert!(
        table.status.success(),
        "{}",
        String::from_utf8_lossy(&table.stderr)
    );
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(text.contains("NODE n1  (Tesla-P100)"), "{text}");
    assert!(text.contains("default/n3-a"), "{text}");

    let json_out = Command::new(env!("CARGO_BIN_EXE_kubectl-tessera"))
        .args(["inspect", "--json", "--node", "n2", "--kubeconfig"])
        .arg(&kubeconfig)
        .output()
        .expect("runs");
    assert!(
        json_out.status.success(),
        "{}",
        String::from_utf8_lossy(&json_out.stderr)
    );
    let nodes: serde_json::Value = serde_json::from_slice(&json_out.stdout).expect("JSON");
    assert_eq!(nodes.as_array().map(Vec::len), Some(1));
    assert_eq!(nodes[0]["name"], "n2");
    assert_eq!(
        nodes[0]["gpus"][1]["memoryAllocated"],
        json!(12207u64 << 20)
    );
    assert_eq!(nodes[0]["gpus"][1]["pods"][0]["pod"], "default/n2-b");

    let missing = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(["inspect", "--kubeconfig", "/nonexistent"])
        .output()
        .expect("runs");
    assert_eq!(missing.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("reading kubeconfig /nonexistent"));
}
