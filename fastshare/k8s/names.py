"""Kubernetes' rules for the names a user types on the controller's command line or in the
manifests' values (those of apimachinery's validation), so that a typo stops the controller at
start or the manifests as they are rendered, instead of the API server refusing it later (a Lease
name, a label selector, `kubectl apply`) or, for a namespace, the controller quietly serving
nothing."""

from __future__ import annotations

import re

_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_LABEL = re.compile(rf"^{_LABEL}$")
_DNS_SUBDOMAIN = re.compile(rf"^{_LABEL}(\.{_LABEL})*$")
_DNS_1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_QUALIFIED = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


def namespace_problem(value: str) -> str | None:
    """Why ``value`` cannot be a namespace (a DNS-1123 label), or None."""
    if len(value) <= 63 and _DNS_LABEL.fullmatch(value):
        return None
    return "must be at most 63 lower-case letters, digits and '-', starting and ending with a letter or digit"


def name_problem(value: str) -> str | None:
    """Why ``value`` cannot be an object name such as a Lease's (a DNS-1123 subdomain), or None."""
    if len(value) <= 253 and _DNS_SUBDOMAIN.fullmatch(value):
        return None
    return ("must be at most 253 lower-case letters, digits, '-' and '.', each part starting and ending "
            "with a letter or digit")


def service_name_problem(value: str) -> str | None:
    """Why ``value`` cannot be a Service's name (a DNS-1035 label: it is a DNS name), or None."""
    if len(value) <= 63 and _DNS_1035_LABEL.fullmatch(value):
        return None
    return ("must be at most 63 lower-case letters, digits and '-', starting with a letter and ending with a "
            "letter or digit")


def labelled_name_problem(value: str) -> str | None:
    """Why ``value`` cannot be the name of an object that is also the value of its Pods' label
    (a DNS-1123 subdomain of at most 63 characters), or None."""
    if len(value) <= 63 and _DNS_SUBDOMAIN.fullmatch(value):
        return None
    return ("must be at most 63 lower-case letters, digits, '-' and '.', each part starting and ending "
            "with a letter or digit (it is also a label value)")


def label_value_problem(value: str) -> str | None:
    """Why ``value`` cannot be a label's value, or None."""
    if value == "" or (len(value) <= 63 and _QUALIFIED.fullmatch(value)):
        return None
    return ("must be empty or at most 63 letters, digits, '-', '_' and '.', starting and ending with a "
            "letter or digit")


def label_key_problem(value: str) -> str | None:
    """Why ``value`` cannot be a label key (``[prefix/]name``), or None."""
    prefix, slash, name = value.rpartition("/")
    if (not slash or name_problem(prefix) is None) and len(name) <= 63 and _QUALIFIED.fullmatch(name):
        return None
    return ("must be [PREFIX/]NAME: NAME at most 63 letters, digits, '-', '_' and '.', starting and "
            "ending with a letter or digit; PREFIX a DNS subdomain such as fastshare.io")


MAX_COMMON_NAME = 64   # X.509's upper bound for a Common Name


def node_cn_problem(value: str) -> str | None:
    """Why ``value`` cannot be a node certificate's common name for a Kubernetes node (a node
    name that fits X.509's 64 characters), or None."""
    return name_problem(value) or (f"longer than {MAX_COMMON_NAME} characters"
                                   if len(value) > MAX_COMMON_NAME else None)
