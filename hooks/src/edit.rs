//! Applying `tessera.hook.v1` container edits, and merging several hooks' edits.

use tessera_protos::hook::v1::{ContainerHookRequest, ContainerHookResponse, LinuxResources};

/// Applies `edit` to the container described by `container`: removals first, then
/// additions, each replacing an entry with the same key (env key, device or mount
/// container path, CDI name, annotation key). Order of untouched entries is kept;
/// new entries are appended in the edit's order.
pub fn apply(container: &mut ContainerHookRequest, edit: &ContainerHookResponse) {
    container
        .envs
        .retain(|kv| !edit.remove_envs.contains(&kv.key));
    for set in &edit.set_envs {
        match container.envs.iter_mut().find(|kv| kv.key == set.key) {
            Some(existing) => existing.value.clone_from(&set.value),
            None => container.envs.push(set.clone()),
        }
    }
    container
        .devices
        .retain(|d| !edit.remove_devices.contains(&d.container_path));
    for add in &edit.add_devices {
        match container
            .devices
            .iter_mut()
            .find(|d| d.container_path == add.container_path)
        {
            Some(existing) => *existing = add.clone(),
            None => container.devices.push(add.clone()),
        }
    }
    container
        .mounts
        .retain(|m| !edit.remove_mounts.contains(&m.container_path));
    for add in &edit.add_mounts {
        match container
            .mounts
            .iter_mut()
            .find(|m| m.container_path == add.container_path)
        {
            Some(existing) => *existing = add.clone(),
            None => container.mounts.push(add.clone()),
        }
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
    use tessera_protos::hook::v1::{DeviceNode, KeyValue};

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
}
