use k8s_cri::v1::{ContainerConfig, ContainerMetadata, CreateContainerRequest, KeyValue, Mount};
use proptest::prelude::*;
use prost::Message;

use super::*;

/// Appends an unknown field (number 9000 + n, LEN) holding `payload`.
fn unknown(out: &mut Vec<u8>, n: u64, payload: &[u8]) {
    write_varint(out, ((9000 + n) << 3) | u64::from(LEN));
    write_varint(out, payload.len() as u64);
    out.extend_from_slice(payload);
}

fn request(envs: &[(&str, &str)]) -> CreateContainerRequest {
    CreateContainerRequest {
        pod_sandbox_id: "sandbox-1".into(),
        config: Some(ContainerConfig {
            metadata: Some(ContainerMetadata {
                name: "main".into(),
                attempt: 0,
            }),
            envs: envs
                .iter()
                .map(|(k, v)| KeyValue {
                    key: (*k).into(),
                    value: (*v).into(),
                })
                .collect(),
            mounts: vec![Mount {
                container_path: "/data".into(),
                host_path: "/srv".into(),
                ..Default::default()
            }],
            ..Default::default()
        }),
        sandbox_config: None,
    }
}

/// The request encoded with an unknown field at the top and one inside `config`.
fn with_unknowns(req: &CreateContainerRequest) -> Vec<u8> {
    let mut config = req
        .config
        .as_ref()
        .map(Message::encode_to_vec)
        .unwrap_or_default();
    unknown(&mut config, 2, b"inside-config");
    let mut out = Vec::new();
    write_varint(&mut out, 1 << 3 | 2);
    write_varint(&mut out, req.pod_sandbox_id.len() as u64);
    out.extend_from_slice(req.pod_sandbox_id.as_bytes());
    write_varint(&mut out, 2 << 3 | 2);
    write_varint(&mut out, config.len() as u64);
    out.extend_from_slice(&config);
    unknown(&mut out, 1, b"top-level");
    out
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack
        .windows(needle.len())
        .any(|window| window == needle)
}

#[test]
fn unchanged_message_is_forwarded_byte_for_byte() {
    let original = with_unknowns(&request(&[("A", "1")]));
    let decoded = CreateContainerRequest::decode(&original[..])
        .expect("decodes")
        .encode_to_vec();
    assert_eq!(merge(&original, &decoded, &decoded), Ok(original));
}

#[test]
fn rewrite_keeps_unknown_fields_at_every_depth() {
    let original = with_unknowns(&request(&[("A", "1"), ("NVIDIA_VISIBLE_DEVICES", "all")]));
    let typed = CreateContainerRequest::decode(&original[..]).expect("decodes");
    let mut rewritten = typed.clone();
    let config = rewritten.config.as_mut().expect("config");
    config.envs[1].value = "GPU-1234".into();
    config.envs.push(KeyValue {
        key: "B".into(),
        value: "2".into(),
    });

    let merged = merge(
        &original,
        &typed.encode_to_vec(),
        &rewritten.encode_to_vec(),
    )
    .expect("merges");
    assert_eq!(
        CreateContainerRequest::decode(&merged[..]).expect("decodes"),
        rewritten
    );
    assert!(contains(&merged, b"top-level"));
    assert!(contains(&merged, b"inside-config"));
}

#[test]
fn removed_fields_are_gone() {
    let original = with_unknowns(&request(&[("A", "1"), ("B", "2")]));
    let typed = CreateContainerRequest::decode(&original[..]).expect("decodes");
    let mut rewritten = typed.clone();
    let config = rewritten.config.as_mut().expect("config");
    config.envs.retain(|kv| kv.key != "A");
    config.mounts.clear();
    let merged = merge(
        &original,
        &typed.encode_to_vec(),
        &rewritten.encode_to_vec(),
    )
    .expect("merges");
    assert_eq!(
        CreateContainerRequest::decode(&merged[..]).expect("decodes"),
        rewritten
    );
    assert!(contains(&merged, b"inside-config"));
}

#[test]
fn malformed_input_is_an_error_not_a_panic() {
    assert_eq!(
        parse(&[0x0a, 0x05, 1]).map(|_| ()),
        Err(WireError::Truncated(0))
    );
    assert_eq!(parse(&[0xff; 11]).map(|_| ()), Err(WireError::Varint(0)));
    assert!(parse(&[0x0f]).is_err());
    assert!(parse(&[0x0c]).is_err());
}

proptest! {
    #[test]
    fn merge_yields_the_rewrite_and_keeps_unknowns(
        envs in proptest::collection::vec(("[A-Z_]{1,8}", "[a-z0-9-]{0,12}"), 0..6),
        keep in proptest::collection::vec(any::<bool>(), 6),
        added in proptest::collection::vec(("[A-Z_]{1,8}", "[a-z0-9-]{0,12}"), 0..3),
        drop_mounts in any::<bool>(),
    ) {
        let pairs: Vec<(&str, &str)> = envs.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let original = with_unknowns(&request(&pairs));
        let typed = CreateContainerRequest::decode(&original[..]).expect("decodes");
        let mut rewritten = typed.clone();
        let config = rewritten.config.as_mut().expect("config");
        let mut index = 0;
        config.envs.retain(|_| { index += 1; keep[index - 1] });
        config.envs.extend(added.iter().map(|(k, v)| KeyValue { key: k.clone(), value: v.clone() }));
        if drop_mounts { config.mounts.clear(); }

        let merged = merge(&original, &typed.encode_to_vec(), &rewritten.encode_to_vec()).expect("merges");
        prop_assert_eq!(CreateContainerRequest::decode(&merged[..]).expect("decodes"), rewritten);
        prop_assert!(contains(&merged, b"top-level"));
        prop_assert!(contains(&merged, b"inside-config"));
    }

    #[test]
    fn parse_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
        let _ = parse(&bytes);
        let _ = merge(&bytes, &bytes, &[]);
    }
}
