#!/usr/bin/python
# Copyright: (c) 2026, fastshare developers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Ansible module: fastshare's Kubernetes manifests, rendered by fastshare's own renderer."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: k8s_manifests
short_description: Render fastshare's Kubernetes manifests
version_added: 0.1.0
description:
  - Renders the FastPod CRD, namespace, RBAC, controller Deployment, node agent DaemonSet and
    Service from the same templates as C(fastshare k8s manifests) (C(fastshare.k8s.manifests)),
    so Ansible applies exactly what the in-cluster installation uses.
  - Only renders; apply the result with M(kubernetes.core.k8s).
author:
  - fastshare developers (@fastshare)
options:
  values:
    description:
      - Overrides for the templates' defaults (C(fastshare/k8s/templates/defaults.yaml)), for
        example C(namespace), C(image), C(controller.replicas). Nested mappings are merged.
    type: dict
    default: {}
attributes:
  check_mode:
    description: Only renders, so it runs fully in check mode.
    support: full
  diff_mode:
    description: Nothing changes.
    support: none
  platform:
    description: Any host with the fastshare package.
    support: full
    platforms: posix
requirements:
  - The C(fastshare) Python package (with its C(kubernetes) templates) for the interpreter
    the module runs with.
seealso:
  - module: kubernetes.core.k8s
"""

EXAMPLES = r"""
- name: Render the manifests on the control node
  fastshare.gpu.k8s_manifests:
    values:
      namespace: gpu-sharing
      image: registry.example/fastshare:0.1.0
  delegate_to: localhost
  register: fastshare_manifests

- name: Apply them
  kubernetes.core.k8s:
    definition: "{{ item }}"
    apply: true
    wait: true
  loop: "{{ fastshare_manifests.resources }}"
"""

RETURN = r"""
resources:
  description: The Kubernetes objects in apply order (CRD and namespace first).
  returned: always
  type: list
  elements: dict
  sample: [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "fastshare-system"}}]
namespace:
  description: The namespace the namespaced objects live in.
  returned: always
  type: str
  sample: fastshare-system
merged_values:
  description:
    - The values the manifests were rendered from, the templates' defaults with O(values) merged
      in; for example C(controller.tlsSecret) and C(agent.caConfigMap) in it name the cluster
      CA's Secret and ConfigMap.
  returned: always
  type: dict
  sample: {"namespace": "fastshare-system", "controller": {"tlsSecret": "fastshare-controller-tls"}}
"""

import traceback  # noqa: E402  (Ansible: imports follow the docs)

from ansible.module_utils.basic import AnsibleModule, missing_required_lib  # noqa: E402

try:
    from fastshare.k8s import manifests
except ImportError:
    HAS_FASTSHARE = False
    FASTSHARE_IMPORT_ERROR = traceback.format_exc()
else:
    HAS_FASTSHARE = True
    FASTSHARE_IMPORT_ERROR = None


def main():
    module = AnsibleModule(argument_spec=dict(values=dict(type="dict", default={})),
                           supports_check_mode=True)
    if not HAS_FASTSHARE:
        module.fail_json(msg=missing_required_lib("fastshare"), exception=FASTSHARE_IMPORT_ERROR)
    try:
        resources = manifests.render(module.params["values"])
        values = manifests.merged_values(module.params["values"])
    except manifests.ValuesError as exc:
        module.fail_json(msg=f"values: {exc}")
    namespace = next((r["metadata"]["name"] for r in resources if r["kind"] == "Namespace"), "")
    module.exit_json(changed=False, resources=resources, namespace=namespace, merged_values=values)


if __name__ == "__main__":
    main()
