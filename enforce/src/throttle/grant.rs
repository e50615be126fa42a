//! A container's grant as the proxy writes it for the throttle: read, checked,
//! and its share of each GPU.

use super::*;

impl Grant {
    /// Its percent of GPU `uuid`'s time.
    pub fn percent_on(&self, uuid: &str) -> u64 {
        self.gpus
            .iter()
            .position(|g| g == uuid)
            .and_then(|i| self.percents.get(i))
            .copied()
            .unwrap_or(self.percent)
    }

    pub(super) fn file_name(&self) -> String {
        format!("{}_{}", self.pod_uid, self.container_id)
    }

    /// Checks what a grant file or a hook gives: names safe as one path
    /// component, a real container ID, a share below a whole GPU.
    pub(super) fn check(self) -> Result<Self, ThrottleError> {
        let safe = |s: &str| {
            !s.is_empty()
                && s.len() <= 128
                && s.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
        };
        if !safe(&self.pod_uid) || self.pod_uid.starts_with('.') {
            return Err(ThrottleError::Grant(format!(
                "pod UID {:?} is not a UID",
                self.pod_uid
            )));
        }
        if container_id_of(Path::new(&self.container_id)).as_deref()
            != Some(self.container_id.as_str())
        {
            return Err(ThrottleError::Grant(format!(
                "container ID {:?} is not 64 hex digits",
                self.container_id
            )));
        }
        if !(1..100).contains(&self.percent) {
            return Err(ThrottleError::Grant(format!(
                "{} percent is not a share of a GPU (1-99)",
                self.percent
            )));
        }
        if self.gpus.is_empty() || !self.gpus.iter().all(|g| safe(g)) {
            return Err(ThrottleError::Grant(format!(
                "GPUs {:?} are not GPU UUIDs",
                self.gpus
            )));
        }
        if !self.percents.is_empty()
            && (self.percents.len() != self.gpus.len()
                || !self.percents.iter().all(|p| (1..=100).contains(p)))
        {
            return Err(ThrottleError::Grant(format!(
                "percents {:?} are not one share (1-100) for each of GPUs {:?}",
                self.percents, self.gpus
            )));
        }
        Ok(self)
    }

    pub(super) fn to_text(&self, cgroup: Option<&Path>) -> String {
        let mut text = format!("percent={}\ngpus={}\n", self.percent, self.gpus.join(","));
        // A file without it (an older proxy's) holds `percent` on each GPU.
        if !self.percents.is_empty() {
            let each: Vec<String> = self.percents.iter().map(u64::to_string).collect();
            text.push_str(&format!("percents={}\n", each.join(",")));
        }
        if let Some(dir) = cgroup {
            text.push_str(&format!("cgroup={}\n", dir.display()));
        }
        text
    }

    /// A grant file: its name (`<pod uid>_<container id>`) and its lines.
    pub(super) fn from_file(
        name: &str,
        text: &str,
    ) -> Result<(Self, Option<PathBuf>), ThrottleError> {
        let (pod_uid, container_id) = name
            .split_once('_')
            .ok_or_else(|| ThrottleError::Grant(format!("file name {name:?} is not <pod>_<id>")))?;
        let field = |key: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(key)?.strip_prefix('='))
        };
        let percent = field("percent")
            .and_then(|p| p.parse().ok())
            .ok_or_else(|| ThrottleError::Grant(format!("{name}: no percent=")))?;
        let gpus = field("gpus")
            .map(|g| g.split(',').map(str::to_owned).collect())
            .unwrap_or_default();
        let percents = match field("percents") {
            None => Vec::new(),
            Some(list) => list
                .split(',')
                .map(|p| p.parse().ok())
                .collect::<Option<Vec<u64>>>()
                .ok_or_else(|| ThrottleError::Grant(format!("{name}: percents={list}")))?,
        };
        let grant = Grant {
            pod_uid: pod_uid.to_owned(),
            container_id: container_id.to_owned(),
            percent,
            gpus,
            percents,
        }
        .check()?;
        let cgroup = field("cgroup").map(PathBuf::from);
        if let Some(dir) = &cgroup
            && (!dir.is_absolute()
                || dir
                    .components()
                    .any(|c| c == std::path::Component::ParentDir)
                || container_id_of(dir).as_deref() != Some(grant.container_id.as_str()))
        {
            return Err(ThrottleError::Grant(format!(
                "{name}: cgroup {} is not the container's",
                dir.display()
            )));
        }
        Ok((grant, cgroup))
    }
}
