//! The manifests in deploy/, read as JSON values, for tests that hold them to the code.

use serde::Deserialize;
use serde_json::Value;

/// Every YAML document of `deploy/<name>`.
pub fn documents(name: &str) -> Vec<Value> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../deploy")
        .join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    parse(&text).expect("YAML")
}

/// Every YAML document of `text` (an empty one as null), as JSON values.
pub fn parse(text: &str) -> Result<Vec<Value>, serde_yaml::Error> {
    serde_yaml::Deserializer::from_str(text)
        .map(Value::deserialize)
        .collect()
}

/// Whether one of the rules of RBAC `role` grants `verb` on `resource`.
pub fn role_allows(role: &Value, resource: &str, verb: &str) -> bool {
    let lists = |list: &Value, item: &str| {
        list.as_array()
            .is_some_and(|items| items.iter().any(|x| x == item))
    };
    role["rules"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|rule| lists(&rule["resources"], resource) && lists(&rule["verbs"], verb))
}
