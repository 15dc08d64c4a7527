#!/usr/bin/env bash
# Download the coding-agent CLIs that slime.agent.harness installs into sandboxes (npm tarballs of their
# linux-x64 native builds, ~180 MB each) into a cache, and print the variables that name them:
#
#   eval "$(bash scripts/fetch-agent-clis.sh)"     # sets SLIME_AGENT_CC_TARBALL and SLIME_AGENT_CODEX_TARBALL
#
# The cache is ${SLIME_AGENT_CLI_CACHE:-~/.cache/slime/agent-clis}; a tarball already there is not fetched again.
# Needs npm (the registry only). Without it, nothing is printed and the harness tests that need the CLIs skip.
set -euo pipefail
CLAUDE_CODE="@anthropic-ai/claude-code-linux-x64@2.1.332"
CODEX="@openai/codex@0.171.0-linux-x64"
cache="${SLIME_AGENT_CLI_CACHE:-$HOME/.cache/slime/agent-clis}"
if ! command -v npm >/dev/null 2>&1; then
  echo "fetch-agent-clis: npm not found; the Claude Code / Codex harness tests will skip" >&2
  exit 0
fi
mkdir -p "$cache"
fetch() {  # fetch SPEC FILE: npm pack SPEC into the cache as FILE unless it is there
  local spec=$1 file=$cache/$2
  if [ ! -s "$file" ]; then
    local tmp; tmp=$(mktemp -d "$cache/.pack.XXXXXX")
    if ! (cd "$tmp" && npm pack --silent "$spec" >/dev/null 2>&1); then
      echo "fetch-agent-clis: npm pack $spec failed; its harness test will skip" >&2
      rm -rf "$tmp"; return 1
    fi
    mv "$tmp"/*.tgz "$file" && rm -rf "$tmp"
  fi
  echo "$file"
}
if cc=$(fetch "$CLAUDE_CODE" claude-code-linux-x64-2.1.332.tgz); then echo "export SLIME_AGENT_CC_TARBALL=$cc"; fi
if cx=$(fetch "$CODEX" codex-linux-x64-0.171.0.tgz); then echo "export SLIME_AGENT_CODEX_TARBALL=$cx"; fi
