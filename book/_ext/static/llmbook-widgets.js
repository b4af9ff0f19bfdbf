// ipywidgets' embed manager typesets widget labels through the MathJax 2 API (MathJax.Hub.Queue),
// but the site runs MathJax 3, whose global object has no Hub: every widget then fails to render.
// This bridge gives MathJax 3 a minimal Hub.Queue that forwards to typesetPromise. MathJax 3
// replaces window.MathJax when it starts, so the bridge is (re)installed until the page settles.
(function () {
  function install() {
    var mj = window.MathJax;
    if (mj && !mj.Hub) {
      mj.Hub = {
        Queue: function (command) {
          var element = command && command[2];
          if (window.MathJax.typesetPromise) {
            window.MathJax.typesetPromise(element ? [element] : undefined).catch(function () {});
          }
        },
      };
    }
  }
  install();
  var tries = 0;
  var timer = setInterval(function () {
    install();
    tries += 1;
    if (tries > 100) { clearInterval(timer); }
  }, 50);
  document.addEventListener("DOMContentLoaded", install);
})();
