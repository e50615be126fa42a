//! Filter's and prioritize's answers are written by hand ([`encode_filter`],
//! [`encode_scores`]) for speed: byte for byte what serde_json writes of them.

use proptest::prelude::*;
use serde_json::json;

use super::*;

fn scores<'a>(hosts: &[(&'a str, i64)]) -> Vec<HostScore<'a>> {
    hosts
        .iter()
        .map(|&(host, score)| HostScore { host, score })
        .collect()
}

#[test]
fn scores_are_written_as_serde_json_writes_them() {
    let odd = "quote\" back\\slash \u{1} tab\t nœud ü \u{7f} /";
    for hosts in [
        vec![],
        vec![("node-00001", 0)],
        vec![("a", 3), ("b", 9), ("c", 10), ("d", 11), ("e", -1)],
        vec![(odd, i64::MAX), ("", i64::MIN)],
    ] {
        let answer = scores(&hosts);
        let ours = encode_scores(&answer).expect("encoded");
        assert_eq!(
            String::from_utf8_lossy(&ours),
            serde_json::to_string(&answer).expect("serde")
        );
    }
}

#[test]
fn filter_answers_are_written_as_serde_json_writes_them() {
    let odd = "quote\" back\\slash \u{1f} nœud";
    let answers = [
        FilterAnswer::default(),
        FilterAnswer {
            node_names: Some(vec!["n1", "n2", odd]),
            ..FilterAnswer::default()
        },
        FilterAnswer {
            nodes: Some(json!({"items": [{"metadata": {"name": "n1"}}]})),
            node_names: Some(vec![]),
            failed_nodes: BTreeMap::from([
                ("n2", "full \"now\"".to_owned()),
                (odd, "50 percent".to_owned()),
            ]),
            failed_and_unresolvable_nodes: BTreeMap::from([("n3", "no Device CR\n".to_owned())]),
            error: "not \\ used".into(),
        },
    ];
    for answer in &answers {
        let ours = encode_filter(answer).expect("encoded");
        assert_eq!(
            String::from_utf8_lossy(&ours),
            serde_json::to_string(answer).expect("serde")
        );
    }
}

proptest! {
    /// Any names, any scores and reasons: the same bytes as serde_json.
    #[test]
    fn any_answer_is_written_as_serde_json_writes_it(
        names in prop::collection::vec(any::<String>(), 0..8),
        numbers in prop::collection::vec(any::<i64>(), 8),
        reason in any::<String>(),
    ) {
        let hosts: Vec<(&str, i64)> = names.iter().map(String::as_str).zip(numbers.iter().copied()).collect();
        let answer = scores(&hosts);
        prop_assert_eq!(encode_scores(&answer).expect("encoded"), serde_json::to_vec(&answer).expect("serde"));
        let split = names.len() / 2;
        let answer = FilterAnswer {
            nodes: None,
            node_names: Some(names[..split].iter().map(String::as_str).collect()),
            failed_nodes: names[split..].iter().map(|n| (n.as_str(), reason.clone())).collect(),
            failed_and_unresolvable_nodes: names[..split].iter().map(|n| (n.as_str(), reason.clone())).collect(),
            error: reason.clone(),
        };
        prop_assert_eq!(encode_filter(&answer).expect("encoded"), serde_json::to_vec(&answer).expect("serde"));
    }
}
