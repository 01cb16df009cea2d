# Copyright: (c) 2026, fastshare developers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Jinja filter: a command (list of arguments) as a systemd ExecStart= value."""

from __future__ import annotations

DOCUMENTATION = r"""
---
name: systemd_command
short_description: A command line for systemd's ExecStart= and the other Exec settings
version_added: 0.1.0
description:
  - Joins a command, given as a list of arguments, into the value of a systemd C(ExecStart=)
    (or C(ExecStartPre=), C(ExecStop=), ...) setting, so that systemd passes every argument
    through exactly as it is given, whatever characters a path or a value contains.
  - Following C(systemd.service(5)) and C(systemd.syntax(7)), an argument that is empty, is a
    lone C(;) (a command separator unquoted) or has
    whitespace, a quote, a backslash or a control character is put in double quotes, with
    C(\), C(") and control characters C-escaped; C(%) becomes C(%%) (no specifier) everywhere
    and C($) becomes C($$) (no environment variable) in the arguments after the executable.
  - Arguments without such characters stay as they are, so a unit of ordinary paths reads as before.
  - systemd refuses an executable path with a quote, a backslash or a control character
    however it is written; the filter fails for such a path instead of writing a unit that
    does not load.
author:
  - fastshare developers (@fastshare)
positional: _input
options:
  _input:
    description: The command, the absolute path of the executable first.
    type: list
    elements: str
    required: true
"""

EXAMPLES = r"""
- name: A unit whose virtualenv path has a space
  ansible.builtin.copy:
    dest: /etc/systemd/system/example.service
    mode: "0644"
    content: |
      [Service]
      ExecStart={{ ['/opt/my venv/bin/fastshare', 'node', 'serve'] | fastshare.gpu.systemd_command }}
  # ExecStart="/opt/my venv/bin/fastshare" node serve
"""

RETURN = r"""
_value:
  description: The command line, for the right-hand side of C(ExecStart=).
  type: str
  sample: '"/opt/my venv/bin/fastshare" mig config --file /etc/fastshare/100%%.yaml'
"""

import re  # noqa: E402  (Ansible: imports follow the docs)

from ansible.errors import AnsibleFilterError  # noqa: E402

# Characters that end or change a word unless quoted: whitespace, quotes, backslash, control.
_NEEDS_QUOTES = re.compile(r"[\s\"'\\\x00-\x1f\x7f]")
_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def systemd_quote(arg, dollar="$$"):
    """One argument as systemd reads it back unchanged (the executable: dollar="$")."""
    text = str(arg)
    # A lone unquoted ';' separates two commands; quoted it is an argument like any other.
    if text and text != ";" and not _NEEDS_QUOTES.search(text):
        return text.replace("%", "%%").replace("$", dollar)
    quoted = "".join(_ESCAPES.get(c, f"\\x{ord(c):02x}" if ord(c) < 0x20 or ord(c) == 0x7f else c)
                     for c in text)
    return '"' + quoted.replace("%", "%%").replace("$", dollar) + '"'


def systemd_command(argv):
    if isinstance(argv, (str, bytes)) or not isinstance(argv, (list, tuple)) or not argv:
        raise AnsibleFilterError(f"systemd_command: expected a non-empty list of arguments, got {argv!r}")
    executable = str(argv[0])
    if not executable.startswith("/"):
        raise AnsibleFilterError(f"systemd_command: the executable must be an absolute path, "
                                 f"got {executable!r}")
    if re.search(r"[\"'\\\x00-\x1f\x7f]", executable):
        raise AnsibleFilterError(f"systemd_command: systemd refuses an executable path with a quote, "
                                 f"a backslash or a control character, got {executable!r}")
    # The executable path gets no environment variable substitution: a $ in it stays as it is.
    return " ".join([systemd_quote(executable, dollar="$")] + [systemd_quote(a) for a in argv[1:]])


class FilterModule:
    def filters(self):
        return {"systemd_command": systemd_command}
