# bash completion for gpupoolctl. Commands and options come from `gpupoolctl --help` (one
# list, the program's own); unpublish completes the keys `gpupoolctl names` shows and
# drop-client the pids `gpupoolctl clients` shows, when the daemon answers (both are admin
# requests: nothing is offered otherwise).

_gpupoolctl_ask() {
  # Runs gpupoolctl on the socket the command line names, quietly and briefly.
  local i sock=()
  for ((i = 1; i < COMP_CWORD; i++)); do
    case ${COMP_WORDS[i]} in
      -s | --socket) sock=(--socket "${COMP_WORDS[i + 1]}") ;;
      --socket=*) sock=("${COMP_WORDS[i]}") ;;
    esac
  done
  "${COMP_WORDS[0]}" "${sock[@]}" --timeout 2 "$@" 2>/dev/null
}

_gpupoolctl() {
  local cur prev words cword cmd="" i help
  cur=${COMP_WORDS[COMP_CWORD]}
  prev=${COMP_WORDS[COMP_CWORD - 1]}
  case $prev in
    -s | --socket)
      COMPREPLY=($(compgen -f -- "$cur"))
      compopt -o filenames 2>/dev/null
      return ;;
    -t | --timeout)
      COMPREPLY=($(compgen -W "0 1 5 10 30 60" -- "$cur"))
      return ;;
  esac
  for ((i = 1; i < COMP_CWORD; i++)); do
    case ${COMP_WORDS[i]} in
      -s | --socket | -t | --timeout) ((i++)) ;;
      -*) ;;
      *) cmd=${COMP_WORDS[i]}; break ;;
    esac
  done
  help=$("${COMP_WORDS[0]}" --help 2>/dev/null)
  if [[ -z $cmd ]]; then
    if [[ $cur == -* ]]; then
      COMPREPLY=($(compgen -W "$(sed -n 's/^  \(-[a-zA-Z]\), \(--[a-z-]*\).*/\1 \2/p' <<<"$help")" -- "$cur"))
    else
      COMPREPLY=($(compgen -W "$(sed -n '/^Commands:/,/^$/s/^  \([a-z][a-z-]*\).*/\1/p' <<<"$help")" -- "$cur"))
    fi
    return
  fi
  # The one argument of the commands that take one.
  [[ $i -eq $((COMP_CWORD - 1)) ]] || return
  case $cmd in
    unpublish)
      COMPREPLY=($(compgen -W "$(_gpupoolctl_ask names | awk 'NR > 1 { print $1 }')" -- "$cur")) ;;
    drop-client)
      COMPREPLY=($(compgen -W "$(_gpupoolctl_ask clients | awk 'NR > 1 { print $2 }')" -- "$cur")) ;;
  esac
}
complete -F _gpupoolctl gpupoolctl
