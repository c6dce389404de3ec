// A minimal typed event emitter (no DOM EventTarget needed, works in Node and browsers).

/**
 * @template {Record<string, any>} Events map of event name → payload type
 */
export class Emitter {
  constructor() {
    /** @type {Map<keyof Events, Set<(payload: any) => void>>} */
    this.listeners = new Map();
  }

  /**
   * Listen to an event.
   * @template {keyof Events} K
   * @param {K} type
   * @param {(payload: Events[K]) => void} listener
   * @returns {() => void} a function that removes the listener
   */
  on(type, listener) {
    let set = this.listeners.get(type);
    if (!set) this.listeners.set(type, (set = new Set()));
    set.add(listener);
    return () => this.off(type, listener);
  }

  /**
   * @template {keyof Events} K
   * @param {K} type
   * @param {(payload: Events[K]) => void} listener
   */
  off(type, listener) {
    this.listeners.get(type)?.delete(listener);
  }

  /**
   * Listen to the next event of this type only.
   * @template {keyof Events} K
   * @param {K} type
   * @param {(payload: Events[K]) => void} listener
   * @returns {() => void}
   */
  once(type, listener) {
    const off = this.on(type, (payload) => {
      off();
      listener(payload);
    });
    return off;
  }

  /**
   * @template {keyof Events} K
   * @param {K} type
   * @param {Events[K]} payload
   */
  emit(type, payload) {
    for (const listener of [...(this.listeners.get(type) ?? [])]) {
      try {
        listener(payload);
      } catch (err) {
        // A failing listener must not break the stream; report it asynchronously.
        setTimeout(() => {
          throw err;
        }, 0);
      }
    }
  }
}
