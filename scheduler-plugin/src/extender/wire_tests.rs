//! Filter's and prioritize's arguments read in place ([`wire::usual_args`]): the
//! same as serde_json reads them, whatever the body, and in place for the usual one.

use proptest::prelude::*;
use serde_json::{Value, json};

use super::fixtures::share_pod;
use super::*;
use crate::protocol::ExtenderArgsIn;

/// What serde_json and [`wire::read_args`] read, side by side: the pod, whether
/// nodes came, and the names; or the error's text.
fn both(body: &[u8]) -> (Result<String, String>, Result<String, String>) {
    let show = |args: serde_json::Result<ExtenderArgsIn<'_>>| {
        args.map(|args| {
            let names: Option<Vec<&str>> = args
                .node_names
                .as_ref()
                .map(|names| names.iter().map(|n| n.0.as_ref()).collect());
            let nodes = args.nodes.map(|n| json!(n));
            format!("{:?} {nodes:?} {names:?}", args.pod)
        })
        .map_err(|e| e.to_string())
    };
    (
        show(serde_json::from_slice::<ExtenderArgsIn>(body)),
        show(wire::read_args(body)),
    )
}

fn names(count: usize) -> Vec<String> {
    (0..count).map(|i| format!("node-{i:05}")).collect()
}

/// kube-scheduler's body: every name a slice of the body, the pod as serde_json reads it.
#[test]
fn the_usual_body_is_read_in_place() {
    let body = serde_json::to_vec(&json!({"Pod": share_pod("a", 50), "NodeNames": names(500)}))
        .expect("body");
    let (pod, read) = wire::usual_args(&body).expect("the usual shape");
    let expected: Pod = serde_json::from_value(share_pod("a", 50)).expect("pod");
    assert_eq!(pod, expected);
    assert_eq!(read.len(), 500);
    assert!(read.iter().all(|n| matches!(n.0, Cow::Borrowed(_))));
    let read: Vec<&str> = read.iter().map(|n| n.0.as_ref()).collect();
    assert_eq!(read, names(500));
    let (serde, ours) = both(&body);
    assert_eq!(ours, serde);
}

/// Any spacing and order of keys, `"Nodes": null`, no names: still in place.
#[test]
fn spacing_order_and_null_nodes_are_read_in_place() {
    let pod = serde_json::to_string(&share_pod("a", 50)).expect("pod");
    for body in [
        format!(
            " {{ \"NodeNames\" : [ \"n1\" ,\n\"n2\" ] ,\t\"Nodes\" : null , \"Pod\" : {pod} }} \r\n"
        ),
        format!("{{\"Pod\":{pod},\"NodeNames\":[]}}"),
        format!("{{\"Nodes\":null,\"NodeNames\":[\"nœud-ü\"],\"Pod\":{pod}}}"),
    ] {
        assert!(wire::usual_args(body.as_bytes()).is_some(), "{body}");
        let (serde, ours) = both(body.as_bytes());
        assert!(serde.is_ok(), "{serde:?}");
        assert_eq!(ours, serde, "{body}");
    }
}

/// Every other shape goes to serde_json, which reads it (or refuses it) as before.
#[test]
fn other_shapes_go_to_serde_json() {
    let pod = serde_json::to_string(&share_pod("a", 50)).expect("pod");
    let nodes = json!({"items": [{"metadata": {"name": "n1"}}]});
    let bodies = [
        format!(r#"{{"Pod":{pod},"NodeNames":["a\"b","c"]}}"#),
        format!(r#"{{"Pod":{pod},"NodeNames":["\u0041"]}}"#),
        format!("{{\"Pod\":{pod},\"NodeNames\":[\"tab\tinside\"]}}"),
        format!(r#"{{"Pod":{pod},"NodeNames":["a"],"NodeNames":["b"]}}"#),
        format!(r#"{{"Pod":{pod},"NodeNames":["a"],"Extra":1}}"#),
        format!(r#"{{"Pod":{pod},"Nodes":{nodes}}}"#),
        format!(r#"{{"Pod":{pod},"NodeNames":null}}"#),
        format!(r#"{{"Pod":{pod},"NodeNames":["a"]}} x"#),
        format!(r#"{{"Pod":{pod},"NodeNames":["a"]"#),
        format!(r#"{{"Pod":{pod},"NodeNames":["a",]}}"#),
        format!(r#"{{"Pod":{pod},"Nodes":nullx,"NodeNames":["a"]}}"#),
        r#"{"NodeNames":["a"]}"#.to_owned(),
        r#"{"Pod":{"metadata":{"name":7}},"NodeNames":["a"]}"#.to_owned(),
        r#"{"Pod":,"NodeNames":["a"]}"#.to_owned(),
        r#"{"Pod":}"#.to_owned(),
        String::new(),
    ];
    for body in &bodies {
        assert!(wire::usual_args(body.as_bytes()).is_none(), "{body}");
        let (serde, ours) = both(body.as_bytes());
        assert_eq!(ours, serde, "{body}");
    }
    let mut invalid = format!(r#"{{"Pod":{pod},"NodeNames":["a"#).into_bytes();
    invalid.extend_from_slice(b"\xff\"]}");
    assert!(wire::usual_args(&invalid).is_none());
    let (serde, ours) = both(&invalid);
    assert_eq!(ours, serde);
}

/// A JSON value as text with `space` around its tokens.
fn spaced(value: &Value, space: &str) -> String {
    match value {
        Value::Object(map) => {
            let fields: Vec<String> = map
                .iter()
                .map(|(k, v)| format!("{space}{}{space}:{space}{}", json!(k), spaced(v, space)))
                .collect();
            format!("{{{}{space}}}", fields.join(","))
        }
        Value::Array(items) => {
            let items: Vec<String> = items
                .iter()
                .map(|v| format!("{space}{}", spaced(v, space)))
                .collect();
            format!("[{}{space}]", items.join(","))
        }
        other => other.to_string(),
    }
}

proptest! {
    /// Any names (escapes, control characters, any Unicode), any spacing, keys in
    /// any order, with or without `"Nodes": null` or an extra key: the same as serde_json.
    #[test]
    fn any_body_reads_as_serde_json_reads_it(
        names in prop::collection::vec(any::<String>(), 0..6),
        space in prop::sample::select(vec!["", " ", "\n\t", "\r\n  "]),
        pod_first in any::<bool>(),
        nodes_null in any::<bool>(),
        extra in any::<bool>(),
        cut in any::<prop::sample::Index>(),
    ) {
        let pod = share_pod("a", 50);
        let mut fields = vec![("NodeNames", json!(names))];
        if pod_first { fields.insert(0, ("Pod", pod)); } else { fields.push(("Pod", pod)); }
        if nodes_null { fields.push(("Nodes", Value::Null)); }
        if extra { fields.push(("Extra", json!([1, "x"]))); }
        let entries: Vec<String> = fields
            .iter()
            .map(|(k, v)| format!("{space}\"{k}\"{space}:{space}{}", spaced(v, space)))
            .collect();
        let body = format!("{space}{{{}{space}}}{space}", entries.join(","));
        let (serde, ours) = both(body.as_bytes());
        prop_assert!(serde.is_ok());
        prop_assert_eq!(&ours, &serde);
        // Cut short anywhere: refused alike.
        let short = &body.as_bytes()[..cut.index(body.len())];
        let (serde, ours) = both(short);
        prop_assert_eq!(ours, serde);
    }
}

proptest! {
    /// Eight bytes at a time, the same as one at a time, wherever the first quote,
    /// backslash or control character sits (or none).
    #[test]
    fn plain_prefix_stops_where_a_byte_at_a_time_stops(
        mut bytes in prop::collection::vec(0x20u8..=0xff, 0..40),
        special in prop::sample::select(vec![b'"', b'\\', 0x00, 0x1f, 0x0a]),
        at in any::<prop::sample::Index>(),
        put in any::<bool>(),
    ) {
        bytes.retain(|&b| b != b'"' && b != b'\\');
        if put && !bytes.is_empty() {
            let at = at.index(bytes.len());
            bytes[at] = special;
        }
        let naive = bytes
            .iter()
            .position(|&b| b == b'"' || b == b'\\' || b < 0x20)
            .unwrap_or(bytes.len());
        prop_assert_eq!(wire::plain_prefix(&bytes), naive);
    }
}
