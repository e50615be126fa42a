//! Applying `tessera.hook.v1` container edits, and merging several hooks' edits.

use crate::hook::v1::{ContainerHookRequest, ContainerHookResponse, LinuxResources};

/// Applies `edit` to the container described by `container`: removals first, then
/// additions, each replacing every entry with the same key (env key, device or mount
/// container path, CDI name, annotation key). Order of untouched entries is kept;
/// a replaced entry takes the place of the first one it replaces, new entries are
/// appended in the edit's order.
pub fn apply(container: &mut ContainerHookRequest, edit: &ContainerHookResponse) {
    container
        .envs
        .retain(|kv| !edit.remove_envs.contains(&kv.key));
    for set in &edit.set_envs {
        replace_all(&mut container.envs, set, |kv| kv.key == set.key);
    }
    container
        .devices
        .retain(|d| !edit.remove_devices.contains(&d.container_path));
    for add in &edit.add_devices {
        replace_all(&mut container.devices, add, |d| {
            d.container_path == add.container_path
        });
    }
    container
        .mounts
        .retain(|m| !edit.remove_mounts.contains(&m.container_path));
    for add in &edit.add_mounts {
        replace_all(&mut container.mounts, add, |m| {
            m.container_path == add.container_path
        });
    }
    container
        .cdi_devices
        .retain(|c| !edit.remove_cdi_devices.contains(&c.name));
    for add in &edit.add_cdi_devices {
        if !container.cdi_devices.iter().any(|c| c.name == add.name) {
            container.cdi_devices.push(add.clone());
        }
    }
    for key in &edit.remove_annotations {
        container.annotations.remove(key);
    }
    for (key, value) in &edit.set_annotations {
        container.annotations.insert(key.clone(), value.clone());
    }
    if let Some(overrides) = &edit.resources {
        let resources = container
            .resources
            .get_or_insert_with(LinuxResources::default);
        override_resources(resources, overrides);
    }
}

/// Puts `new` in place of every entry of `entries` that `same_key` matches: the
/// one place an edit sets a keyed entry. Every match goes, not only the first:
/// kubelet sends a device plugin's env before the pod's, so a key can come twice,
/// and containerd and the NVIDIA toolkit obey the last entry. Replacing only the
/// first would leave a later, pod-written value in charge (`[void, all]`).
fn replace_all<T: Clone>(entries: &mut Vec<T>, new: &T, same_key: impl Fn(&T) -> bool) {
    let Some(first) = entries.iter().position(&same_key) else {
        entries.push(new.clone());
        return;
    };
    entries[first] = new.clone();
    let mut index = 0;
    entries.retain(|entry| {
        let keep = index <= first || !same_key(entry);
        index += 1;
        keep
    });
}

/// Copies the set (non-zero, non-empty) fields of `overrides` onto `resources`.
pub fn override_resources(resources: &mut LinuxResources, overrides: &LinuxResources) {
    let set = |target: &mut i64, value: i64| {
        if value != 0 {
            *target = value;
        }
    };
    set(&mut resources.cpu_period, overrides.cpu_period);
    set(&mut resources.cpu_quota, overrides.cpu_quota);
    set(&mut resources.cpu_shares, overrides.cpu_shares);
    set(
        &mut resources.memory_limit_in_bytes,
        overrides.memory_limit_in_bytes,
    );
    set(&mut resources.oom_score_adj, overrides.oom_score_adj);
    if !overrides.cpuset_cpus.is_empty() {
        resources.cpuset_cpus.clone_from(&overrides.cpuset_cpus);
    }
    if !overrides.cpuset_mems.is_empty() {
        resources.cpuset_mems.clone_from(&overrides.cpuset_mems);
    }
}

#[cfg(test)]
mod tests {
    use crate::hook::v1::{DeviceNode, KeyValue};

    use super::*;

    fn kv(key: &str, value: &str) -> KeyValue {
        KeyValue {
            key: key.into(),
            value: value.into(),
        }
    }

    #[test]
    fn later_edit_wins_and_devices_stay_unique() {
        let mut container = ContainerHookRequest {
            envs: vec![kv("A", "1"), kv("B", "2")],
            ..Default::default()
        };
        let first = ContainerHookResponse {
            set_envs: vec![kv("A", "first"), kv("C", "3")],
            add_devices: vec![DeviceNode {
                container_path: "/dev/x".into(),
                host_path: "/h/1".into(),
                permissions: "rw".into(),
            }],
            ..Default::default()
        };
        let second = ContainerHookResponse {
            set_envs: vec![kv("A", "second")],
            remove_envs: vec!["B".into()],
            add_devices: vec![DeviceNode {
                container_path: "/dev/x".into(),
                host_path: "/h/2".into(),
                permissions: "rwm".into(),
            }],
            ..Default::default()
        };
        apply(&mut container, &first);
        apply(&mut container, &second);
        assert_eq!(container.envs, vec![kv("A", "second"), kv("C", "3")]);
        assert_eq!(container.devices.len(), 1);
        assert_eq!(container.devices[0].host_path, "/h/2");
    }

    #[test]
    fn a_set_replaces_every_entry_of_its_key() {
        // kubelet's order: the device plugin's value, the pod's own, then the pod's again.
        let device = |host: &str| DeviceNode {
            container_path: "/dev/nvidia0".into(),
            host_path: host.into(),
            permissions: "rw".into(),
        };
        let mut container = ContainerHookRequest {
            envs: vec![
                kv("NVIDIA_VISIBLE_DEVICES", "GPU-a"),
                kv("PATH", "/bin"),
                kv("NVIDIA_VISIBLE_DEVICES", "all"),
                kv("NVIDIA_VISIBLE_DEVICES", "GPU-b"),
            ],
            devices: vec![device("/dev/nvidia0"), device("/dev/nvidia2")],
            ..Default::default()
        };
        let edit = ContainerHookResponse {
            set_envs: vec![kv("NVIDIA_VISIBLE_DEVICES", "void")],
            add_devices: vec![device("/dev/nvidia1")],
            ..Default::default()
        };
        apply(&mut container, &edit);
        assert_eq!(
            container.envs,
            vec![kv("NVIDIA_VISIBLE_DEVICES", "void"), kv("PATH", "/bin")]
        );
        assert_eq!(container.devices, vec![device("/dev/nvidia1")]);
    }

    proptest::proptest! {
        #[test]
        fn after_a_set_its_key_appears_once_with_the_set_value(
            envs in proptest::collection::vec(("[ABK]", "[a-z]{0,3}"), 0..12),
            value in "[a-z]{0,3}",
        ) {
            let mut container = ContainerHookRequest {
                envs: envs.iter().map(|(k, v)| kv(k, v)).collect(),
                ..Default::default()
            };
            let others: Vec<KeyValue> =
                container.envs.iter().filter(|e| e.key != "K").cloned().collect();
            apply(
                &mut container,
                &ContainerHookResponse { set_envs: vec![kv("K", &value)], ..Default::default() },
            );
            let set: Vec<KeyValue> =
                container.envs.iter().filter(|e| e.key == "K").cloned().collect();
            proptest::prop_assert_eq!(set, vec![kv("K", &value)]);
            let rest: Vec<KeyValue> =
                container.envs.iter().filter(|e| e.key != "K").cloned().collect();
            proptest::prop_assert_eq!(rest, others, "other entries and their order kept");
        }
    }
}
