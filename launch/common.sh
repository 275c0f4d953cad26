# shellcheck shell=bash
# Shared helpers of the launch scripts (sourced, not run). The caller sets SCRIPT (its name, for
# messages) and DRY_RUN (1: print commands instead of running them).

die() { echo "$SCRIPT: $*" >&2; exit 2; }

# Shell-quote one word for printing: bare when safe, else in single quotes.
shq() {
  if [[ -n "$1" && "$1" =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then
    printf '%s' "$1"
  else
    printf "'%s'" "${1//\'/\'\\\'\'}"
  fi
}

# Run a command, or print it (one line, every word quoted) under --dry-run.
run() {
  local out="" word
  for word in "$@"; do out+="$(shq "$word") "; done
  if [[ $DRY_RUN == 1 ]]; then
    echo "${out% }"
  else
    echo "+ ${out% }" >&2
    "$@"
  fi
}

# An option's value must follow it and must not be another option.
need_value() { [[ $# -ge 2 && -n "$2" && "$2" != --* ]] || die "$1 needs a value"; }
